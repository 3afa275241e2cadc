"""torchrun worker (1 process): each shipped config's model built on the meta device (shapes,
no memory), and the transformers model of the same architecture on the meta device: the
parameter counts, and the Hugging Face mapping covering every tensor name and shape, also
sliced for each rank at the config's tensor-parallel size. Prints one JSON line a config.

argv: config...
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from del_megatron import DigitVocab, NumericLossConfig
from del_megatron.config import load_run_config
from del_megatron.models import build_llama
from del_megatron.models.hf_config import hf_config
from del_megatron.models.hf_names import hf_shapes
from del_megatron.models.hf_tensors import (
    canonical,
    check_hf_tensors,
    hf_tensors,
    rank_shard,
    reader_of,
)
from del_megatron.models.sharding import partition_of, split
from del_megatron.training.plan import count_parameters


def check(path: str) -> dict:
    import transformers

    cfg = load_run_config(path)
    arch, tp = cfg.model, cfg.parallel.tensor_parallel
    digits = DigitVocab(digit_ids=list(range(10, 20)), vocab_size=arch.vocab_size)
    with torch.device("meta"):
        model = build_llama(arch, digits, NumericLossConfig(), torch.device("cpu"), seed=0)
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config(arch))
    params = dict(model.named_parameters())
    built = sum(p.numel() for p in params.values())
    counted = count_parameters(arch, 1)
    assert counted.total == built, (path, counted.total, built)

    hf_state = {n: t for n, t in hf_model.state_dict().items() if not n.endswith("inv_freq")}
    if arch.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)
    assert {n: tuple(t.shape) for n, t in hf_state.items()} == hf_shapes(arch), path
    check_hf_tensors({n: tuple(t.shape) for n, t in hf_state.items()}, arch)
    read = reader_of(hf_state)
    exported = {}
    per_rank = [0] * tp
    padded_tp = arch.padded_vocab_size(tp)
    for name, param in params.items():
        name = canonical(name)
        full = rank_shard(read, name, arch, arch.padded_vocab_size(1), 0, 1)
        assert full.shape == param.shape, (path, name, full.shape, param.shape)
        exported.update({n: tuple(t.shape) for n, t in hf_tensors(name, full, arch)})
        for rank in range(tp):  # the slices a rank reads are its shard of the full tensor
            shard = rank_shard(read, name, arch, padded_tp, rank, tp)
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                expected = (padded_tp // tp, arch.hidden_size)
            else:
                expected = tuple(split(full, partition_of(name), rank, tp).shape)
            assert tuple(shard.shape) == expected, (path, name, rank, shard.shape, expected)
            per_rank[rank] += shard.numel()
    assert exported == hf_shapes(arch), path
    assert per_rank == [count_parameters(arch, tp).per_rank] * tp, (path, per_rank)
    return {
        "config": path,
        "unpadded": counted.unpadded,
        "hf": sum(t.numel() for t in hf_state.values()),
    }


def main() -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    for path in sys.argv[1:]:
        print("SHAPES " + json.dumps(check(path)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
