"""torchrun worker (one rank): "train further" through the real `train`.

A 4-step run (cosine to optim.min_lr at step 4), then from its checkpoint to step 8 in
three ways: with the default schedule continuation (save at step 6 and 8), with
optim.schedule_on_resume=restart, and again from the continued run's step-6 checkpoint with
its config unchanged (which must follow the continued schedule it was saved with, bit for
bit). Each run writes its metrics.jsonl under OUT/<name>.

argv: tokenizer manifest out
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_path import config as gpu_path_config

from del_megatron.config import parse_run_config
from del_megatron.parallel import end_distributed


def config(tokenizer: str, manifest: str, out: Path, steps: int, schedule: str = "continue"):
    tiny = gpu_path_config(tokenizer, manifest, "del", str(out), steps).model  # its tiny model
    return parse_run_config(
        {
            "model": tiny.model_dump(mode="json"),
            "parallel": {"tensor_parallel": 1, "zero_stage": 1},
            "optim": {"lr": 1e-3, "min_lr": 1e-4, "schedule_on_resume": schedule},
            "train": {
                "steps": steps,
                "micro_batch_size": 2,
                "global_batch_size": 2,
                "seq_len": 32,
                "device": "cpu",
                "log_interval": 1,
                "save_interval": 6,
            },
            "data": {"tokenizer": tokenizer, "sources": [{"manifest": manifest}]},
            "logging": {"wandb": "disabled", "progress_bar": False},
            "output_dir": str(out),
        }
    )


def main() -> None:
    tokenizer, manifest, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    from del_megatron.training.trainer import train

    train(config(tokenizer, manifest, out / "first", 4))
    step4 = str(out / "first" / "checkpoints" / "step-0000004")
    train(config(tokenizer, manifest, out / "continued", 8), resume=step4)
    train(config(tokenizer, manifest, out / "restarted", 8, "restart"), resume=step4)
    step6 = str(out / "continued" / "checkpoints" / "step-0000006")
    train(config(tokenizer, manifest, out / "again", 8), resume=step6)


if __name__ == "__main__":
    main()
    end_distributed()  # as del-train ends: a gloo group alive at exit can abort it
