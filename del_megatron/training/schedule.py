"""Learning-rate schedule: linear warmup, then cosine decay to min_lr; and how it continues
when a resumed run asks for another length or floor.

`Schedule` is the record a run's LambdaLR follows. It is saved with each checkpoint
(`schedule.json`), so a resume of an unchanged run follows the very same function (bit for
bit), and a run extended twice continues from where the last extension left it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

FILE = "schedule.json"  # in a checkpoint directory


def lr_factor(step: int, *, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    """Multipliers of optim.lr by scheduler position (LambdaLR's epoch; position s sets the
    rate of optimizer step s + 1).

    start_factor None: the plain schedule (warmup, cosine to min_ratio at `total`). Set: a
    continued schedule, which from position `start` decays by a cosine from `start_factor`
    (the rate the run had there) to min_ratio at `total`, so the rate has no jump."""

    total: int
    warmup: int
    min_ratio: float
    start: int = 0
    start_factor: float | None = None

    @classmethod
    def of_config(cls, cfg) -> Schedule:
        """The plain schedule of a run config (optim.*, train.steps)."""
        steps = cfg.train.steps
        return cls(
            total=steps,
            warmup=int(cfg.optim.warmup_fraction * steps),
            min_ratio=cfg.optim.min_lr / cfg.optim.lr,
        )

    def factor(self, step: int) -> float:
        if self.start_factor is None or step < self.start:
            return lr_factor(step, total=self.total, warmup=self.warmup, min_ratio=self.min_ratio)
        progress = min(1.0, (step - self.start) / max(1, self.total - self.start))
        spread = self.start_factor - self.min_ratio
        return self.min_ratio + spread * 0.5 * (1 + math.cos(math.pi * progress))

    def continued(self, step: int, *, total: int, min_ratio: float) -> Schedule:
        """From position `step` on: this schedule's rate there, decaying to `min_ratio` at
        `total`."""
        return Schedule(
            total=total,
            warmup=self.warmup,
            min_ratio=min_ratio,
            start=step,
            start_factor=self.factor(step),
        )

    def text(self) -> str:
        """The checkpoint's FILE (saved_schedule reads it)."""
        return json.dumps(asdict(self))


def saved_schedule(directory: Path) -> Schedule | None:
    """The schedule a checkpoint was saved with (None: saved before it was recorded)."""
    try:
        return Schedule(**json.loads((directory / FILE).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        from ..errors import UserError, one_line

        raise UserError(f"{directory / FILE}: unreadable ({one_line(err)})") from None


def reapply(scheduler) -> None:
    """Set the rate of the scheduler's current position again from its function (after a
    checkpoint's state, which holds the rate of the old function, was loaded): through the
    scheduler's own state dict, one position back, then one step."""
    state = scheduler.state_dict()
    state["last_epoch"] = int(state["last_epoch"]) - 1
    scheduler.load_state_dict(state)
    scheduler.step()


def rebase(scheduler, lr: float) -> None:
    """The peak rate of a loaded scheduler set to `lr` (a checkpoint's state holds the peak
    it was saved with) and the current rate made again from it."""
    state = scheduler.state_dict()
    state["base_lrs"] = [lr] * len(state["base_lrs"])
    scheduler.load_state_dict(state)
    reapply(scheduler)
