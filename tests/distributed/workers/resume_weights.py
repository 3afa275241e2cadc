"""torchrun worker: a checkpoint loaded at another data-parallel size restores the weights
exactly, and the optimizer's own fp32 copy of them too (a step at lr 0 leaves them unchanged;
a stale ZeRO master copy would overwrite them with the weights it was built from).

argv: checkpoint_dir config_file override...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from del_megatron.config import load_run_config
from del_megatron.models.sharding import gather_full
from del_megatron.parallel import end_distributed
from del_megatron.training import checkpointing
from del_megatron.training.trainer import setup, train_step


def main() -> None:
    path, config, *overrides = sys.argv[1:]
    cfg = load_run_config(config, overrides)
    run = setup(cfg)
    step = checkpointing.load(run, Path(path), None)
    saved = load_file(str(Path(path) / "model" / "tp00.safetensors"))  # TP 1: the whole model
    module = run.engine.module

    def assert_saved_weights(when: str) -> None:
        for name, value in gather_full(module).items():
            assert torch.equal(value, saved[name]), f"{when}: {name} differs from the checkpoint"

    assert_saved_weights("after loading")
    for group in run.engine.optimizer.param_groups:
        group["lr"] = 0.0
    vocab = run.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(run.dp_rank)
    batch = torch.randint(
        0, vocab, (cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=gen
    )
    micro = {
        "tokens": batch[:, :-1],
        "labels": batch[:, 1:],
        "loss_mask": torch.ones(batch[:, 1:].shape),
    }
    train_step(run, [micro] * run.accumulation, step + 1)
    assert_saved_weights("after a step at lr 0")
    if dist.get_rank() == 0:
        print(f"OK weights of step {step} restored at data-parallel size {run.dp_size}")


if __name__ == "__main__":
    main()
    end_distributed()  # as del-train ends: a gloo group alive at exit can abort it
