"""Training metrics as exact reductions of [sum, count] pairs, and where they are shown."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


class PairSum:
    """Sums report dicts {name: [sum, count]} over micro-batches; reduce() over ranks."""

    def __init__(self) -> None:
        self.totals: dict[str, torch.Tensor] = {}

    def add(self, report: dict[str, torch.Tensor]) -> None:
        for name, pair in report.items():
            pair = pair.detach().to(torch.float64).cpu()
            self.totals[name] = self.totals[name] + pair if name in self.totals else pair

    def reduce(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Means over every micro-batch of every rank of `group` (one all-reduce)."""
        names = sorted(self.totals)
        if not names:
            return {}
        stacked = torch.stack([self.totals[n] for n in names])  # [metrics, 2]
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(stacked, group=group)
        return {
            n: s / c if c > 0 else float("nan")
            for n, (s, c) in zip(names, stacked.tolist(), strict=True)
        }


class WandbSink:
    """wandb on rank 0, offline unless configured online; the API key is read by wandb from
    the environment and never passed, stored or printed by us."""

    def __init__(
        self, mode: str, project: str, run_name: str | None, out_dir: str, config: dict[str, Any]
    ) -> None:
        self.run = None
        if mode == "disabled":
            return
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise ValueError("logging.wandb=online needs WANDB_API_KEY in the environment")
        import wandb

        os.makedirs(out_dir, exist_ok=True)
        self.run = wandb.init(
            mode=mode,
            project=project,
            name=run_name,
            dir=out_dir,
            config=config,
            settings=wandb.Settings(silent=True),
        )

    def log(self, values: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def console_line(step: int, total: int, values: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    for key, fmt in (
        ("loss", ".4f"),
        ("ce", ".4f"),
        ("numeric", ".4f"),
        ("digit_acc", ".3f"),
        ("digit_entropy", ".3f"),
        ("grad_norm", ".3f"),
        ("lr", ".2e"),
        ("tokens_per_s", ".0f"),
        ("tflops", ".1f"),
        ("mfu", ".3f"),
    ):
        if key in values:
            parts.append(f"{key} {values[key]:{fmt}}")
    return " | ".join(parts)
