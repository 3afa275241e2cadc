"""A del-megatron weights directory (a checkpoint's model/, or del-convert's) exported as a
Hugging Face checkpoint, a tensor at a time (memory: one output shard plus one tensor)."""

from __future__ import annotations

from pathlib import Path

from .hf_config import hf_config
from .hf_tensors import hf_tensors, megatron_names
from .weight_files import DTYPES, HFWriter, MegatronWeights


def export_hf(
    checkpoint: str | Path, out: str | Path, *, dtype: str | None = None, force: bool = False
) -> str:
    """Write the export; returns "family, dtype". dtype: the stored (training) dtype unless
    given. The output appears complete or not at all (HFWriter)."""
    weights = MegatronWeights(checkpoint)
    arch = weights.arch
    dtype_name = dtype or weights.dtype
    config = hf_config(arch, dtype_name)  # refuses what the family cannot express, first
    writer = HFWriter(out, force=force)
    try:
        for name in megatron_names(arch):
            for hf_name, tensor in hf_tensors(name, weights.full(name), arch):
                writer.add(hf_name, tensor.to(DTYPES[dtype_name]))
        tokenizer = weights.tokenizer()
        writer.finish(config, tokenizer.parent if tokenizer else None)
    except BaseException:
        writer.abandon()
        raise
    return f"{arch.family}, {dtype_name}"
