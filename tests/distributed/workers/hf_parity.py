"""torchrun worker: each Hugging Face checkpoint imported at TP = world size gives the logits
transformers computed (saved by the test), and exports back (gathered, canonical names) to
the identical tensors; rank 0 writes the export with del-megatron's writer.

argv: (hf_dir expected_logits.pt export_dir)...
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from del_megatron import DigitVocab, NumericLossConfig
from del_megatron.models import build_llama
from del_megatron.models.hf_config import architecture_from_hf, hf_config
from del_megatron.models.hf_tensors import canonical, hf_tensors
from del_megatron.models.sharding import gather_full, partition_of, partition_of_param
from del_megatron.models.weight_files import HFCheckpoint, HFWriter
from del_megatron.models.weights import load_hf
from tests.utils import assert_close


def check(hf_dir: str, expected_path: str, export_dir: str) -> str:
    world = dist.get_world_size()
    checkpoint = HFCheckpoint(hf_dir)
    arch = architecture_from_hf(checkpoint.config, divisible_by=64)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), vocab_size=arch.vocab_size)
    model = build_llama(arch, vocab, NumericLossConfig(), torch.device("cpu"), seed=0)
    load_hf(model, checkpoint, arch)
    for name, param in model.named_parameters():  # the offline table agrees with megatron
        assert partition_of(name) == partition_of_param(param), name

    expected = torch.load(expected_path, weights_only=True)
    tokens = expected["tokens"]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        shard = model(tokens, positions, None)  # [b, s, V/tp]
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous())
    logits = torch.cat(parts, dim=-1)[..., : arch.vocab_size]
    assert_close(logits, expected["logits"], atol=1e-5, what=f"{hf_dir} logits at TP {world}")

    exported = {}
    for name, full in gather_full(model).items():
        exported.update(hf_tensors(canonical(name), full, arch))
    assert exported.keys() == checkpoint.shapes.keys() - (
        {"lm_head.weight"} if arch.tie_word_embeddings else set()
    )
    for name, tensor in exported.items():  # import -> export is the identity
        assert torch.equal(tensor, checkpoint.read(name, None, None, None)), name
    if dist.get_rank() == 0:
        writer = HFWriter(export_dir, shard_bytes=40_000)  # several shards and an index
        for name, tensor in exported.items():
            writer.add(name, tensor)
        writer.finish(hf_config(arch, "float32"), hf_dir)
    dist.barrier()
    return f"OK {arch.family} at TP {world}"


def main() -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    args = sys.argv[1:]
    for i in range(0, len(args), 3):
        message = check(*args[i : i + 3])
        if dist.get_rank() == 0:
            print(message, args[i], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
