"""Training metrics as exact reductions of [sum, count] pairs, and where they are shown."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..outputs import write_text_atomic


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
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):  # preflight says so first
            raise ConfigError("logging.wandb=online needs WANDB_API_KEY in the environment")
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


class Reporter:
    """Each step's values, shown and kept (rank 0 only; other ranks get a silent one):
    progress bar, a console line every `log_interval` steps and at the last, one exact JSON
    line a step in `metrics.jsonl`, wandb.

    metrics.jsonl describes the run whose checkpoints are in the output directory: on a
    start at step `start`, lines of later steps (trained, then lost with the process) are
    dropped, so a resumed run's file holds every step once.
    """

    def __init__(self, cfg: Any, *, start: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.total = cfg.train.steps
        self.log_interval = cfg.train.log_interval
        self.enabled = enabled
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        self.sink = WandbSink(
            cfg.logging.wandb if enabled else "disabled",
            cfg.logging.project,
            cfg.logging.run_name,
            cfg.output_dir,
            cfg.model_dump(mode="json"),
        )
        if enabled:
            keep_steps_up_to(self.path, start)
        self.bar = tqdm(
            total=self.total,
            initial=start,
            disable=not (enabled and cfg.logging.progress_bar and sys.stderr.isatty()),
            desc="training",
            unit="step",
            dynamic_ncols=True,
        )

    def step(self, step: int, values: dict[str, float]) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{values['loss']:.3f}", digit_acc=f"{values['digit_acc']:.3f}")
        if not self.enabled:
            return
        self.sink.log(values, step)
        with open(self.path, "a") as f:  # exact floats
            f.write(json.dumps({"step": step, **values}) + "\n")
        if step % self.log_interval == 0 or step == self.total:
            self.bar.write(console_line(step, self.total, values))

    def log(self, values: dict[str, float], step: int) -> None:
        """Values outside the step lines (the final evaluation): wandb only."""
        self.sink.log(values, step)

    def message(self, text: str) -> None:
        if self.enabled:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        self.sink.close()


def keep_steps_up_to(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl (atomically) without the lines of steps after `step`."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and _step_of(line) <= step]
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(kept))


def _step_of(line: str) -> float:
    """The step of a metrics line; a line cut by a kill (no newline) was dropped before, a
    line that is not ours is kept (-inf)."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("-inf")
