"""torchrun worker: a run started with init.hf (the whole set-up path: weights, DeepSpeed
engine) computes, on its first step, the loss transformers computed on the same batch.

argv: hf_dir tokenizer batch.pt
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from del_megatron.config import parse_run_config
from del_megatron.models.hf_config import architecture_from_hf
from del_megatron.models.weight_files import HFCheckpoint
from del_megatron.parallel import end_distributed
from del_megatron.training.trainer import setup, train_step


def main() -> None:
    hf_dir, tokenizer, batch_path = sys.argv[1:4]
    arch = architecture_from_hf(HFCheckpoint(hf_dir).config, divisible_by=64)
    batch = torch.load(batch_path, weights_only=True)
    tokens = batch["tokens"]
    cfg = parse_run_config(
        {
            "model": arch.model_dump(),
            "loss": {"kind": "mle"},
            "parallel": {"tensor_parallel": dist_world()},
            "train": {
                "steps": 1,
                "micro_batch_size": tokens.shape[0],
                "global_batch_size": tokens.shape[0],
                "seq_len": tokens.shape[1] - 1,
                "device": "cpu",
            },
            "data": {"tokenizer": tokenizer, "sources": [{"manifest": "unused.json"}]},
            "init": {"hf": hf_dir},
            "logging": {"wandb": "disabled", "progress_bar": False},
        }
    )
    run = setup(cfg)
    micro = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(tokens[:, 1:].shape),
    }
    values = train_step(run, [micro], 1).metrics.values()
    expected = batch["loss"].item()
    assert abs(values["loss"] - expected) <= 1e-5, (values["loss"], expected)
    if dist.get_rank() == 0:
        print(f"OK first-step loss {values['loss']:.7f} = transformers' {expected:.7f}")


def dist_world() -> int:
    import os

    return int(os.environ["WORLD_SIZE"])


if __name__ == "__main__":
    main()
    end_distributed()  # as del-train ends: a gloo group alive at exit can abort it
