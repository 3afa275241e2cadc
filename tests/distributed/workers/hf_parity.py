"""torchrun worker: import a Hugging Face checkpoint at TP = world size, compare logits with
the ones transformers computed (saved by the test), export it back, import the export again.

argv: hf_dir expected_logits.pt export_dir
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from del_megatron import DigitVocab, NumericLossConfig
from del_megatron.models import build_llama
from del_megatron.models.hf import (
    architecture_from_hf,
    gather_full,
    hf_config,
    hf_to_megatron,
    layer_norms_fused,
    load_into,
    megatron_to_hf,
    read_hf_checkpoint,
    write_hf_checkpoint,
)
from tests.utils import assert_close


def main() -> None:
    hf_dir, expected_path, export_dir = sys.argv[1:4]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    config, tensors = read_hf_checkpoint(hf_dir)
    arch = architecture_from_hf(config, divisible_by=64)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), vocab_size=arch.vocab_size)
    model = build_llama(arch, vocab, NumericLossConfig(), torch.device("cpu"))
    padded = arch.padded_vocab_size(world)
    full = hf_to_megatron(tensors, arch, padded, layer_norms_fused=layer_norms_fused(model))
    load_into(model, full)
    from del_megatron.models.hf import partition_of

    for name, param in model.named_parameters():  # the offline table agrees with megatron
        expected = (
            (param.partition_dim, getattr(param, "partition_stride", 1))
            if getattr(param, "tensor_model_parallel", False)
            else None
        )
        assert partition_of(name) == expected, (name, partition_of(name), expected)

    expected = torch.load(expected_path, weights_only=True)
    tokens = expected["tokens"]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        shard = model(tokens, positions, None)  # [b, s, V/tp]
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous())
    logits = torch.cat(parts, dim=-1)[..., : arch.vocab_size]
    assert_close(logits, expected["logits"], atol=1e-5, what=f"logits at TP {world}")

    round_trip = gather_full(model)
    for name, tensor in full.items():
        assert torch.equal(round_trip[name], tensor), name
    exported = megatron_to_hf(round_trip, arch, layer_norms_fused=layer_norms_fused(model))
    assert set(exported) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(exported[name], tensor), name  # import -> export is the identity
    if dist.get_rank() == 0:
        write_hf_checkpoint(
            export_dir, hf_config(arch, config["model_type"]), exported, tokenizer_dir=hf_dir
        )
    dist.barrier()
    again = hf_to_megatron(
        read_hf_checkpoint(export_dir)[1], arch, padded, layer_norms_fused=layer_norms_fused(model)
    )
    for name, tensor in full.items():
        assert torch.equal(again[name], tensor), name  # import -> export -> import
    if dist.get_rank() == 0:
        print(f"OK {config['model_type']} at TP {world}: {len(full)} tensors")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
