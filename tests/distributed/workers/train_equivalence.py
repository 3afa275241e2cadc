"""torchrun worker: 5 optimizer steps of the trainer on fixed global batches. Rank 0 writes
each step's loss and gradient norm (before clipping) to a JSON file and the full parameters
after the last step (gathered across tensor-parallel ranks) beside it (.pt). Run at TP 1 x DP 1
and at TP 2 x DP 2 with each ZeRO stage; the test compares them."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from del_megatron.config import parse_run_config
from del_megatron.models.sharding import gather_full
from del_megatron.training.trainer import next_micro_batches, setup, train_step

SEQ, MICRO, GLOBAL, VOCAB = 32, 2, 8, 800


def config(tokenizer: str, manifest: str, tp: int, zero: int, kind: str):
    return parse_run_config(
        {
            "model": {
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "ffn_hidden_size": 160,
                "num_layers": 2,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "max_position_embeddings": 64,
                # 800 is a multiple of 16 x TP for TP 1 and 2: one padded size, one init
                "make_vocab_size_divisible_by": 16,
            },
            "loss": {"kind": kind.removesuffix("+fused"), "fused_output": kind.endswith("+fused")},
            "parallel": {"tensor_parallel": tp, "zero_stage": zero},
            "optim": {"lr": 1e-3, "warmup_fraction": 0.2, "clip_grad": 1.0},
            "train": {
                "steps": 5,
                "micro_batch_size": MICRO,
                "global_batch_size": GLOBAL,
                "seq_len": SEQ,
                "device": "cpu",
                "log_interval": 1,
            },
            "data": {"tokenizer": tokenizer, "sources": [{"manifest": manifest}]},
            "logging": {"wandb": "disabled", "progress_bar": False},
            "output_dir": "/tmp/del-equivalence",
        }
    )


def global_batches(digit_ids: list[int]):
    """Step -> [GLOBAL, SEQ + 1] token windows (40% digits) and a loss mask."""
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(5):
        window = torch.randint(3, 700, (GLOBAL, SEQ + 1), generator=gen)
        digits = torch.tensor(digit_ids)[torch.randint(10, window.shape, generator=gen)]
        window = torch.where(torch.rand(window.shape, generator=gen) < 0.4, digits, window)
        mask = (torch.rand(GLOBAL, SEQ, generator=gen) > 0.1).float()
        steps.append((window, mask))
    return steps


def main() -> None:
    tokenizer, manifest, tp, zero, kind, out = sys.argv[1:7]
    cfg = config(tokenizer, manifest, int(tp), int(zero), kind)
    from del_megatron.tokenizer import Tokenizer

    digit_ids = [ids[0] for ids in Tokenizer(tokenizer).digit_vocab.digit_ids]
    steps = global_batches(digit_ids)

    def batches(step: int, micro: int):
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_world_size()
        block = micro * dp + parallel_state.get_data_parallel_rank()
        window, mask = steps[step]
        rows = slice(block * MICRO, (block + 1) * MICRO)
        return {"tokens": window[rows, :-1], "labels": window[rows, 1:], "loss_mask": mask[rows]}

    import deepspeed

    run = setup(cfg)
    trajectory = {"losses": [], "grad_norms": []}
    for step in range(1, cfg.train.steps + 1):
        values = train_step(run, next_micro_batches(run, batches, step - 1), step).metrics.values()
        trajectory["losses"].append(values["loss"])
        trajectory["grad_norms"].append(values["grad_norm"])
    module = run.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=int(zero) == 3):
        params = gather_full(module)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(trajectory, f)
        torch.save(params, out + ".pt")
        print("OK", trajectory)


if __name__ == "__main__":
    main()
