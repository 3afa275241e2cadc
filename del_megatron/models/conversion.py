"""Hugging Face checkpoint <-> del-megatron weights directory, both directions, a tensor at a
time through the name table (models/hf_names.py), writing the output completely or not at
all. del-convert (cli/convert.py) parses arguments and calls these; init.hf reads through
`open_hf` too.

Memory: hf_to_megatron holds one tensor-parallel rank's shards; export_hf one output shard
plus one tensor.
"""

from __future__ import annotations

from pathlib import Path

from .architecture import LlamaArchitecture
from .hf_config import architecture_from_hf, hf_config
from .hf_names import megatron_names
from .hf_tensors import check_hf_tensors, hf_tensors, rank_shard
from .weight_files import (
    DTYPES,
    HFCheckpoint,
    HFWriter,
    MegatronWeights,
    tokenizer_in,
    write_weights,
)


def open_hf(directory: str | Path, *, divisible_by: int) -> tuple[HFCheckpoint, LlamaArchitecture]:
    """A Hugging Face checkpoint (headers only) and its architecture, every tensor checked
    against it; ConversionError naming the field or tensor otherwise."""
    checkpoint = HFCheckpoint(directory)
    arch = architecture_from_hf(checkpoint.config, divisible_by=divisible_by)
    check_hf_tensors(checkpoint.shapes, arch)
    return checkpoint, arch


def hf_to_megatron(
    checkpoint: HFCheckpoint,
    arch: LlamaArchitecture,
    out: str | Path,
    *,
    tensor_parallel: int,
    force: bool = False,
    wait: bool = False,
) -> None:
    """<out>/model/: `tensor_parallel` shard files of `checkpoint` (opened by `open_hf`, its
    heads and groups divisible by `tensor_parallel`), arch.json and the tokenizer."""
    arch.check_tensor_parallel(tensor_parallel)
    padded = arch.padded_vocab_size(tensor_parallel)
    names = megatron_names(arch)
    shards = (  # one rank in memory at a time
        {n: rank_shard(checkpoint.read, n, arch, padded, rank, tensor_parallel) for n in names}
        for rank in range(tensor_parallel)
    )
    write_weights(out, shards, arch, tokenizer_in(checkpoint.directory), force=force, wait=wait)


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    force: bool = False,
    wait: bool = False,
) -> str:
    """A del-megatron weights directory (a checkpoint's model/, or hf_to_megatron's) as a
    Hugging Face checkpoint; returns "family, dtype". dtype: the stored (training) dtype
    unless given. The output appears complete or not at all (HFWriter)."""
    weights = MegatronWeights(checkpoint)
    weights.verify()
    arch = weights.arch
    dtype_name = dtype or weights.dtype
    config = hf_config(arch, dtype_name)  # refuses what the family cannot express, first
    writer = HFWriter(out, force=force, wait=wait)
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
