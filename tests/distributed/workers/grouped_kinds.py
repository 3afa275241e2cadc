"""torchrun worker (2 ranks, TP 2): the real `train` on a grouped tokenizer's shards.

Each digit kind other than `del` (del-train's own launch in
tests/training/test_grouped_tokenizer.py covers it) trains 2 steps; then `del` trains 4
steps straight (a checkpoint at step 2), and again from that step-2 checkpoint to step 4 in
a second output directory. Each run writes metrics.jsonl and its checkpoints under
OUT/<name>; the test compares them.

argv: tokenizer manifest vocab_size out
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_path import config as gpu_path_config

from del_megatron.config import parse_run_config
from del_megatron.parallel import end_distributed

KINDS = ("del_distance", "ntl_was", "ntl_mse", "dist2")


def config(tokenizer: str, manifest: str, vocab_size: int, kind: str, out: Path, steps: int):
    tiny = gpu_path_config(tokenizer, manifest, kind, str(out), steps).model  # its tiny model
    # vocab_size + padding to 16·TP: the padded rows differ from the tokenizer's
    model = {**tiny.model_dump(mode="json"), "vocab_size": vocab_size}
    return parse_run_config(
        {
            "model": model,
            "loss": {"kind": kind},
            "parallel": {"tensor_parallel": 2, "zero_stage": 1},
            "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_fraction": 0.25},  # the last step moves
            "train": {
                "steps": steps,
                "micro_batch_size": 2,
                "global_batch_size": 4,  # 2 micro-batches a step: accumulation crosses them
                "seq_len": 64,
                "device": "cpu",
                "log_interval": 1,
                "save_interval": 2,
            },
            "data": {"tokenizer": tokenizer, "sources": [{"manifest": manifest}], "num_workers": 0},
            "eval": {"sources": []},
            "logging": {"wandb": "disabled", "progress_bar": False},
            "output_dir": str(out),
        }
    )


def main() -> None:
    tokenizer, manifest, vocab_size, out = sys.argv[1:5]
    vocab_size, out = int(vocab_size), Path(out)
    from del_megatron.training.trainer import train

    for kind in KINDS:
        train(config(tokenizer, manifest, vocab_size, kind, out / kind, 2), save=False)
    train(config(tokenizer, manifest, vocab_size, "del", out / "straight", 4))
    step2 = str(out / "straight" / "checkpoints" / "step-0000002")
    train(config(tokenizer, manifest, vocab_size, "del", out / "resumed", 4), resume=step2)


if __name__ == "__main__":
    main()
    end_distributed()  # as del-train ends: a gloo group alive at exit can abort it
