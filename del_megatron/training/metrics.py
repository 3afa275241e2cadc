"""Training metrics as exact reductions of [sum, count] pairs, and where they are shown."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import collectives
from ..config import ConfigError
from ..outputs import agreed_fence, lock_lost, write_error, write_text_atomic


class PairSum:
    """Sums report dicts {name: [sum, count]} over micro-batches on the device they come on:
    no host copy and no synchronisation until the values are read."""

    def __init__(self) -> None:
        self.totals: dict[str, torch.Tensor] = {}

    def add(self, report: dict[str, torch.Tensor]) -> None:
        for name, pair in report.items():
            pair = pair.detach().to(torch.float64)
            self.totals[name] = self.totals[name] + pair if name in self.totals else pair

    def reduced(self, group: dist.ProcessGroup | None) -> tuple[list[str], torch.Tensor]:
        """(names, [metrics, 2] sums and counts over every rank of `group`): one all-reduce,
        on the device, no synchronisation."""
        names = sorted(self.totals)
        if not names:
            return [], torch.zeros(0, 2, dtype=torch.float64)
        stacked = torch.stack([self.totals[n] for n in names])
        return names, collectives.all_reduce(stacked, group=group)

    def reduce(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Means over every micro-batch of every rank of `group` (one all-reduce, then one
        host synchronisation)."""
        names, stacked = self.reduced(group)
        return means(names, stacked.tolist())


def means(names: list[str], pairs: list[list[float]]) -> dict[str, float]:
    """{name: sum / count} ('lm loss', megatron's name for the objective, as 'loss')."""
    values = {n: s / c if c > 0 else float("nan") for n, (s, c) in zip(names, pairs, strict=True)}
    if "lm loss" in values:
        values["loss"] = values.pop("lm loss")
    return values


@dataclass
class StepMetrics:
    """One optimizer step's metrics. The [sum, count] pairs (reduced over data-parallel
    ranks) and the gradient norm stay on the compute device until `values`, or the reporter
    on a logging step, reads them; `host` holds what is known on the host already (lr,
    skipped steps, throughput)."""

    names: list[str]
    pairs: torch.Tensor  # [metrics, 2] float64
    grad_norm: torch.Tensor | float | None  # before clipping; DeepSpeed gives either
    host: dict[str, float] = field(default_factory=dict)

    def device_row(self) -> torch.Tensor:
        """[2 * metrics + 1] float64: the pairs, then the gradient norm (NaN if none)."""
        norm = self.grad_norm
        if isinstance(norm, torch.Tensor):
            norm = norm.detach().to(device=self.pairs.device, dtype=torch.float64).reshape(1)
        else:
            value = float("nan") if norm is None else float(norm)
            norm = torch.full((1,), value, dtype=torch.float64, device=self.pairs.device)
        return torch.cat([self.pairs.reshape(-1), norm])

    def from_row(self, row: list[float]) -> dict[str, float]:
        values = means(self.names, [row[i : i + 2] for i in range(0, 2 * len(self.names), 2)])
        if self.grad_norm is not None:
            values["grad_norm"] = row[-1]
        return {**values, **self.host}

    def values(self) -> dict[str, float]:
        """The step's values as floats (one host synchronisation)."""
        return self.from_row(self.device_row().tolist())


def read_steps(pending: list[StepMetrics]) -> list[dict[str, float]]:
    """Values of several steps with one host synchronisation, also when steps have other
    sets of metrics (a log step's gradient probe): the rows are read as one flat tensor."""
    if not pending:
        return []
    rows = [m.device_row() for m in pending]
    flat = torch.cat(rows).tolist()
    table, start = [], 0
    for row in rows:
        table.append(flat[start : start + row.numel()])
        start += row.numel()
    return [m.from_row(row) for m, row in zip(pending, table, strict=True)]


def log_step(step: int, interval: int, total: int) -> bool:
    """Whether `step` (1-based) shows a console line: every `interval` steps and the last."""
    return step % interval == 0 or step == total


def derived_values(values: dict[str, float], loss: Any) -> dict[str, float]:
    """Metrics made of other metrics, on the host from the exact reduced means (no
    synchronisation of their own): `numeric_share`, the numeric term's share of the
    objective, alpha·numeric / loss, for the kinds with a digit term (none for mle, mixce,
    emo). `loss`: the run's loss config (NumericLossConfig)."""
    if loss.kind_spec.digit_term is None or "numeric" not in values or "loss" not in values:
        return {}
    objective = values["loss"]
    share = loss.resolved_alpha * values["numeric"] / objective if objective else float("nan")
    return {"numeric_share": share}


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


# (metric, label on the console line, format): the label is the metric's name, but for the
# diagnostics of docs/losses.md ("Is DEL learned from or escaped?"), shortened so that the
# line stays readable (metrics.jsonl and wandb have the full names)
CONSOLE_COLUMNS = (
    ("loss", "loss", ".4f"),
    ("ce", "ce", ".4f"),
    ("numeric", "numeric", ".4f"),
    ("digit_acc", "digit_acc", ".3f"),
    ("digit_entropy", "digit_entropy", ".3f"),
    ("digit_logit", "logit", ".2f"),
    ("digit_logsumexp", "lse", ".2f"),
    ("numeric_share", "share", ".3f"),
    ("numeric_grad_share", "grad_share", ".3f"),
    ("numeric_grad_cos", "grad_cos", ".2f"),
    ("grad_norm", "grad_norm", ".3f"),
    ("lr", "lr", ".2e"),
    ("tokens_per_s", "tokens_per_s", ".0f"),
    ("tflops", "tflops", ".1f"),
    ("mfu", "mfu", ".3f"),
)


def console_line(step: int, total: int, values: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    for key, label, fmt in CONSOLE_COLUMNS:
        if key in values:
            parts.append(f"{label} {values[key]:{fmt}}")
    return " | ".join(parts)


class Reporter:
    """Each step's values, shown and kept: progress bar, a console line every
    `log_interval` steps and at the last, one exact JSON line a step in `metrics.jsonl`,
    wandb (rank 0 writes; every rank reads the values, so `TrainResult` is the same on all).

    Steps wait in `pending`, their metrics on the device, until a logging step (or `flush`,
    before a checkpoint or a stop) reads them all with one host synchronisation: a GPU
    step is never held up by a metric.

    metrics.jsonl describes the run whose checkpoints are in the output directory: on a
    start at step `start`, lines of later steps (trained, then lost with the process) are
    dropped, so a resumed run's file holds every step once. A job whose output lock was
    taken over writes no line more: each step's agreement carries rank 0's reading of the
    lock, and rank 0 reads it again right before each write (outputs.py, "Fencing").
    """

    def __init__(self, cfg: Any, *, start: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.total = cfg.train.steps
        self.log_interval = cfg.train.log_interval
        self.loss = cfg.loss
        self.enabled = enabled
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        self.pending: list[tuple[int, StepMetrics, dict[str, float]]] = []
        self.sink = WandbSink(
            cfg.logging.wandb if enabled else "disabled",
            cfg.logging.project,
            cfg.logging.run_name,
            cfg.output_dir,
            cfg.model_dump(mode="json"),
        )
        # the job's first write here: asked on every rank (a job that lost the output's
        # lock stops, agreed, outputs.py "Fencing"), rank 0 writes
        agreed_fence(self.path.parent, leader=enabled)
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

    def step(
        self, step: int, metrics: StepMetrics, extra: dict[str, float] | None = None
    ) -> list[tuple[int, dict[str, float]]]:
        """Record step `step`; on a logging step, flush (returns the flushed steps)."""
        self.bar.update(1)
        self.pending.append((step, metrics, extra or {}))
        if log_step(step, self.log_interval, self.total):
            return self.flush(show=True)
        return []

    def flush(self, *, show: bool = False) -> list[tuple[int, dict[str, float]]]:
        """Read and write every pending step (the console line of the last if `show`);
        returns [(step, values)]."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        read = read_steps([m for _, m, _ in pending])
        flushed = [
            (step, {**v, **derived_values(v, self.loss), **extra})
            for (step, _, extra), v in zip(pending, read, strict=True)
        ]
        last_step, last = flushed[-1]
        self.bar.set_postfix(loss=f"{last['loss']:.3f}", digit_acc=f"{last['digit_acc']:.3f}")
        # no line of a job that lost the output's lock (its new holder writes these steps):
        # every step's agreement carries rank 0's reading of the lock (trainer.train_step);
        # rank 0 reads it once more right before the write, alone (a collective here would be
        # a host read more a logging step). Lost in between, it writes nothing and goes on to
        # what follows every flush, the next step's agreement or a save's agreed fence, where
        # every rank stops together (stopping alone would leave the others in a collective)
        if self.enabled and not lock_lost(self.path.parent):
            # exact floats; the steps in one write, so a reader following the file (tail -f, a
            # dashboard) finds whole lines, not one cut where the 8 KiB buffer ran full
            lines = "".join(json.dumps({"step": step, **values}) + "\n" for step, values in flushed)
            try:
                for step, values in flushed:
                    self.sink.log(values, step)
                with open(self.path, "a") as f:
                    f.write(lines)
            except OSError as err:  # a full disk: one line, not a traceback
                raise write_error(self.path.parent, err) from None
            if show:
                self.bar.write(console_line(last_step, self.total, last))
        return flushed

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
