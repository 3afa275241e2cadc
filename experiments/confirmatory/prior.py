"""What the confirmatory experiment is planned from, computed before its run from the earlier
continuation run's committed rows (docs/results/continuations/): the tasks with room to
improve, the spread of the primary endpoints paired by base, the difference the planned
number of bases detects, and the run's minutes on 2 idle cores.

    python -m experiments.confirmatory.prior [DOCS_RESULTS_CONTINUATIONS_DIR]

prints the block docs/results/confirmatory/preregistration.md quotes (a test checks that
the document and `report.ROOM_TASKS` / `report.PLANNED` still say what this prints).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from .. import REPOSITORY
from ..effects import detectable_difference, provable_margin, t_interval
from ..numeric_tasks.report import read_raw
from . import report as cr

EARLIER = REPOSITORY / "docs" / "results" / "continuations"
BASES = (10, 11, 12)  # the planned range; the protocol takes the largest
# Training cost, from docs/log.md (issue 30): a 1500-step numeric-task run trained in
# 300-360 s with its core to itself, process start included: 0.22 s a step.
SECONDS_A_STEP = 330 / 1500
SD_CONFIDENCE = 0.8  # the one-sided upper confidence limit of the SD, planned for too


def room_tasks(rows: list[dict]) -> list[str]:
    """Tasks whose MLE continuations (mean over bases, at their last step) sit at least
    2 x MARGIN below the best digit accuracy any model can reach (1 for exact tasks; the
    noisy scale's true top probabilities): a gain of the margin is possible on them."""
    last = cr.continued(rows)
    out = []
    for task in sorted({r["task"] for r in last}):
        mle = [r for r in last if r["kind"] == cr.BASELINE and r["task"] == task]
        best = statistics.fmean(float(r["best_digit_acc"]) for r in mle)
        acc = statistics.fmean(float(r["digit_acc"]) for r in mle)
        if best - acc >= 2 * cr.MARGIN:
            out.append(task)
    return out


def sd_upper(sd: float, n: int, confidence: float = SD_CONFIDENCE) -> float:
    """The one-sided upper confidence limit of a standard deviation from n values (chi-square
    with n - 1 degrees of freedom)."""
    from scipy.stats import chi2

    return math.sqrt((n - 1) * sd**2 / chi2.ppf(1 - confidence, n - 1))


def planned(rows: list[dict], bases: int = BASES[-1]) -> dict[tuple[str, str], dict]:
    """Per arm and endpoint: the earlier SD of the per-base pooled difference and its upper
    confidence limit, and what `bases` bases detect with each (as report.PLANNED holds it,
    rounded to 4 places)."""
    last = cr.continued(rows)
    strictest = cr.FAMILY_WIDE / len(cr.ENDPOINTS)
    out = {}
    for arm in (cr.PRIMARY_ARM, cr.SECONDARY_ARM):
        for metric, _ in cr.ENDPOINTS:
            diffs = list(cr.differences(last, arm, metric).values())
            sd = statistics.stdev(diffs)
            upper = sd_upper(sd, len(diffs))
            out[(arm, metric)] = {
                "sd": round(sd, 4),
                "sd_upper": round(upper, 4),
                "detectable": round(detectable_difference(sd, bases, strictest, cr.POWER), 4),
                "detectable_upper": round(
                    detectable_difference(upper, bases, strictest, cr.POWER), 4
                ),
                "provable_margin": round(
                    provable_margin(sd, bases, cr.EQUIVALENCE_ALPHA, cr.POWER), 4
                ),
                "provable_margin_upper": round(
                    provable_margin(upper, bases, cr.EQUIVALENCE_ALPHA, cr.POWER), 4
                ),
            }
    return out


def minutes(earlier: dict, protocol) -> tuple[float, float]:
    """The run's minutes on 2 idle cores (2 runs side by side), low and high: the earlier
    run's minutes less its training steps leave the cost of one evaluation (export, load,
    the task suite); greedy answers on every held-out problem instead of `greedy_limit`
    cost between nothing more (low) and the whole evaluation scaled by the ratio (high)."""
    p = earlier["protocol"]
    seeds, arms = len(p["seeds"]), len(p["arms"])
    steps = seeds * p["base_steps"] + seeds * arms * p["steps"]
    evaluations = seeds + seeds * arms
    core_seconds = earlier["minutes"] * 60 * 2
    evaluation = (core_seconds - steps * SECONDS_A_STEP) / evaluations
    mine_arms = len(protocol.arms)
    mine_steps = (
        len(protocol.seeds) * protocol.base_steps
        + len(protocol.seeds) * mine_arms * protocol.steps
        + len(protocol.long_seeds) * mine_arms * protocol.long_steps
    )
    mine_evaluations = len(protocol.seeds) * (1 + mine_arms) + len(protocol.long_seeds) * mine_arms
    greedy = protocol.greedy_limit / p["greedy_limit"]
    low = mine_steps * SECONDS_A_STEP + mine_evaluations * evaluation
    high = mine_steps * SECONDS_A_STEP + mine_evaluations * evaluation * greedy
    return low / 2 / 60, high / 2 / 60


def _named(directory: Path) -> str:
    inside = directory.is_relative_to(REPOSITORY)
    return str(directory.relative_to(REPOSITORY) if inside else directory)


def block(directory: Path = EARLIER) -> str:
    """The planning numbers, as preregistration.md quotes them."""
    from .run import FULL

    rows = read_raw(directory / "raw_runs.jsonl")
    earlier = json.loads((directory / "protocol.json").read_text())
    last = cr.continued(rows)
    out = [
        f"Earlier run: {_named(directory)}"
        f" ({len({r['seed'] for r in last})} bases, {earlier['date']}, "
        f"{earlier['minutes']:.0f} minutes).",
        "",
        "Room to improve (best reachable digit accuracy minus the MLE continuations' mean, "
        f"at least 2 x {cr.MARGIN}):",
        "",
    ]
    room = room_tasks(rows)
    for task in sorted({r["task"] for r in last}):
        mle = [r for r in last if r["kind"] == cr.BASELINE and r["task"] == task]
        best = statistics.fmean(float(r["best_digit_acc"]) for r in mle)
        acc = statistics.fmean(float(r["digit_acc"]) for r in mle)
        out.append(
            f"* {task}: MLE {acc:.3f}, best {best:.3f}, room {best - acc:.3f}"
            + (" (kept)" if task in room else " (left out)")
        )
    out += [
        "",
        "The pooled endpoints in the earlier run (arm minus MLE, per base, 95% t interval):",
        "",
    ]
    for arm in (cr.PRIMARY_ARM, cr.SECONDARY_ARM):
        for metric, label in cr.ENDPOINTS:
            diffs = list(cr.differences(last, arm, metric, room).values())
            i, sd, n = t_interval(diffs), statistics.stdev(diffs), len(diffs)
            out.append(
                f"* {arm}, {label}: {i.mean:+.4f} [{i.low:+.4f}, {i.high:+.4f}], SD {sd:.4f} "
                f"(upper {SD_CONFIDENCE:.0%} limit {sd_upper(sd, n):.4f}), n {n}"
            )
    per_task = [
        statistics.stdev(cr.differences(last, cr.PRIMARY_ARM, "digit_acc", (t,)).values())
        for t in room
    ]
    out += [
        "",
        f"Per task, the SD of {cr.PRIMARY_ARM} minus MLE digit accuracy over bases: "
        f"{min(per_task):.4f} to {max(per_task):.4f} (pooling over tasks averages these).",
        "",
        "Detectable at 80% power (superiority, two-sided t at 0.05 / 2) and provable margin "
        "(TOST, each side at 0.025), for n bases, with the earlier SD / its upper limit:",
        "",
    ]
    for arm in (cr.PRIMARY_ARM, cr.SECONDARY_ARM):
        for metric, label in cr.ENDPOINTS:
            diffs = list(cr.differences(last, arm, metric, room).values())
            sd = statistics.stdev(diffs)
            upper = sd_upper(sd, len(diffs))
            cells = []
            for n in BASES:
                d = detectable_difference(sd, n, cr.FAMILY_WIDE / len(cr.ENDPOINTS), cr.POWER)
                du = detectable_difference(upper, n, cr.FAMILY_WIDE / len(cr.ENDPOINTS), cr.POWER)
                m = provable_margin(sd, n, cr.EQUIVALENCE_ALPHA, cr.POWER)
                mu = provable_margin(upper, n, cr.EQUIVALENCE_ALPHA, cr.POWER)
                cells.append(f"n {n}: ±{d:.4f} / ±{du:.4f}, margin ±{m:.4f} / ±{mu:.4f}")
            out.append(f"* {arm}, {label}: " + "; ".join(cells))
    low, high = minutes(earlier, FULL)
    out += [
        "",
        f"Minutes on 2 idle cores ({len(FULL.seeds)} bases x {len(FULL.arms)} arms x "
        f"{FULL.steps} steps, {len(FULL.long_seeds)} base x {len(FULL.arms)} arms x "
        f"{FULL.long_steps} steps, greedy on {FULL.greedy_limit} problems a task), from the "
        f"earlier run's {earlier['minutes']:.1f} minutes: {low:.0f} to {high:.0f}.",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(block(Path(argv[0]).resolve() if argv else EARLIER), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
