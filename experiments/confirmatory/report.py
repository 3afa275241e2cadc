"""The confirmatory experiment's analysis and page (`run`): does DEL at its default α = 0.1
beat MLE, or equal it within ±0.025, when it continues a model MLE has trained? Fixed and
committed before the run (docs/results/confirmatory/preregistration.md), tested on made-up
rows (tests/experiments/test_confirmatory.py), recomputed from the raw rows alone:

    python -m experiments.confirmatory.report RAW_ROWS.jsonl --out DIR

**Pre-registered.** The unit is the base (one MLE model to step 1000 per seed); every arm
continues it 300 steps on one data order. For each base, an endpoint is the arm's value
minus the MLE continuation's, each averaged with equal weight over ROOM_TASKS (the tasks
where the earlier run's MLE continuations were at least 2 × MARGIN below the best digit
accuracy any model can reach: `prior`). PRIMARY: DEL at α = 0.1 (`del-0.1`) against MLE on
digit accuracy and on teacher-forced exact match (two endpoints, one family):
* superiority / inferiority: two-sided one-sample Student t test of the mean difference
  over bases (n - 1 degrees of freedom), Holm-corrected over the two endpoints at 5%;
* equivalence within ±MARGIN: two one-sided tests (TOST), each at EQUIVALENCE_ALPHA =
  0.05 / 2 (Bonferroni over the two endpoints), i.e. the 95% t interval inside ±MARGIN.
Each endpoint's verdict follows `verdict`; the experiment's answer `answer`. SECONDARY: the
shift-invariant DEL at α = 0.1 (`del_si-0.1`) against MLE, the same tests in a family of
its own. Exploratory (leads, never findings): greedy exact match on every held-out problem
(pooled the same way), each task's difference, an exact sign-flip test beside each t test
(no normality assumed), the escape's training metrics, and the long continuations (one
base, 1,000 steps: whether anything emerges after the escape's plateau; no test, n = 1).
Bases lacking an arm's row on a room task are left out of that comparison, and the page
says how many were used. Detectable differences: before the run from the earlier run's
spread (PLANNED, computed by `prior`), after it from this run's own.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from del_megatron.errors import UserError
from del_megatron.outputs import write_text_atomic

from ..continuations.report import level_table, record_run, report_main
from ..effects import (
    MIN_PAIRS,
    detectable_difference,
    equivalence_p,
    holm,
    paired_p,
    provable_margin,
    sign_flip_p,
    t_interval,
)

MARGIN = 0.025  # the equivalence margin, in the endpoint's units (a share of digits/answers)
FAMILY_WIDE = 0.05  # over the two endpoints of one family (Holm; Bonferroni for TOST)
EQUIVALENCE_ALPHA = FAMILY_WIDE / 2  # each one-sided test of each endpoint's TOST
POWER = 0.8
BASELINE = "mle"
PRIMARY_ARM = "del-0.1"
SECONDARY_ARM = "del_si-0.1"
ENDPOINTS = (  # (metric, label)
    ("digit_acc", "digit accuracy"),
    ("exact_teacher_forced", "exact match, teacher-forced"),
)
# Fixed before the run from the earlier run's MLE rows (`prior.room_tasks`; a test checks
# the two agree): every task but the noisy scale, whose MLE continuations were 0.034 below
# its best reachable digit accuracy (0.709), less than 2 x MARGIN.
ROOM_TASKS = ("add", "add_carries", "convert", "copy", "multiply", "reformat", "subtract")
GREEDY = ("exact_greedy", "exact match, greedy (every held-out problem)")
# The detectable differences before the run (`python -m experiments.confirmatory.prior`,
# from docs/results/continuations/raw_runs.jsonl; a test recomputes them): per arm and
# endpoint, the earlier run's SD of the per-base pooled difference (4 bases) and its upper
# 80% confidence limit, and with each at n = PLANNED_BASES the smallest difference the
# superiority test finds and the smallest margin TOST establishes, with 80% power at the
# levels above.
PLANNED = {
    ("del-0.1", "digit_acc"): {
        "sd": 0.0069,
        "sd_upper": 0.012,
        "detectable": 0.007,
        "detectable_upper": 0.0121,
        "provable_margin": 0.0071,
        "provable_margin_upper": 0.0123,
    },
    ("del-0.1", "exact_teacher_forced"): {
        "sd": 0.0012,
        "sd_upper": 0.0021,
        "detectable": 0.0012,
        "detectable_upper": 0.0022,
        "provable_margin": 0.0013,
        "provable_margin_upper": 0.0022,
    },
    ("del_si-0.1", "digit_acc"): {
        "sd": 0.0066,
        "sd_upper": 0.0114,
        "detectable": 0.0066,
        "detectable_upper": 0.0115,
        "provable_margin": 0.0068,
        "provable_margin_upper": 0.0117,
    },
    ("del_si-0.1", "exact_teacher_forced"): {
        "sd": 0.0044,
        "sd_upper": 0.0076,
        "detectable": 0.0044,
        "detectable_upper": 0.0077,
        "provable_margin": 0.0045,
        "provable_margin_upper": 0.0078,
    },
}
PLANNED_BASES = 12


# ---- the endpoint ------------------------------------------------------------------------


def continued(rows: list[dict], steps: int | None = None) -> list[dict]:
    """The continuations' evaluated rows of one length (default: the shortest, the
    protocol's `steps`; a long continuation's kind is `ARM@STEPS`)."""
    evaluated = [r for r in rows if r["task"] != "_train" and r["kind"] != "base"]
    if not evaluated:
        raise UserError("no evaluated continuation in the raw rows")
    steps = min(r["step"] for r in evaluated) if steps is None else steps
    return [r for r in evaluated if r["step"] == steps]


def pooled(
    rows: list[dict], kind: str, metric: str, tasks: Iterable[str] = ROOM_TASKS
) -> dict[int, float]:
    """Per base: the equal-weight mean of `metric` over `tasks`, for bases with every task."""
    tasks = tuple(tasks)
    values: dict[int, dict[str, float]] = {}
    for r in rows:
        if r["kind"] == kind and r["task"] in tasks and metric in r:
            values.setdefault(r["seed"], {})[r["task"]] = float(r[metric])
    return {
        seed: statistics.fmean(by_task[t] for t in tasks)
        for seed, by_task in values.items()
        if all(t in by_task and not math.isnan(by_task[t]) for t in tasks)
    }


def differences(
    rows: list[dict], arm: str, metric: str, tasks: Iterable[str] = ROOM_TASKS
) -> dict[int, float]:
    """Per base: the arm's pooled value minus the MLE continuation's (bases with both)."""
    tasks = tuple(tasks)
    mine, theirs = pooled(rows, arm, metric, tasks), pooled(rows, BASELINE, metric, tasks)
    return {s: mine[s] - theirs[s] for s in sorted(mine.keys() & theirs.keys())}


@dataclass(frozen=True)
class Test:
    """One endpoint's tests on the per-base differences."""

    n: int
    mean: float
    sd: float
    low: float  # the 1 - 2 * EQUIVALENCE_ALPHA (95%) Student t interval
    high: float
    p: float  # superiority / inferiority, two-sided, before Holm
    p_equivalence: float  # TOST at ±MARGIN
    p_sign_flip: float  # exact, two-sided (exploratory)
    detectable: float  # the smallest |difference| the t test finds at POWER, at Holm's first level
    provable_margin: float  # the smallest margin TOST establishes at POWER if the truth is 0


def endpoint_test(diffs: list[float], family_size: int = len(ENDPOINTS)) -> Test:
    n = len(diffs)
    interval = t_interval(diffs, confidence=1 - 2 * EQUIVALENCE_ALPHA)
    sd = statistics.stdev(diffs) if n >= 2 else math.nan
    strictest = FAMILY_WIDE / family_size  # Holm's first step
    return Test(
        n=n,
        mean=interval.mean,
        sd=sd,
        low=float(interval.low),
        high=float(interval.high),
        p=paired_p(diffs),
        p_equivalence=equivalence_p(diffs, MARGIN),
        p_sign_flip=sign_flip_p(diffs),
        detectable=detectable_difference(sd, n, strictest, POWER),
        provable_margin=provable_margin(sd, n, EQUIVALENCE_ALPHA, POWER),
    )


def verdict(test: Test, p_holm: float) -> str:
    """One endpoint's pre-registered verdict (no claim from fewer than MIN_PAIRS bases:
    with 2, a discrete metric often moves by the same amount at both, a zero spread)."""
    if test.n < MIN_PAIRS:
        return f"no test (fewer than {MIN_PAIRS} bases)"
    different = not math.isnan(p_holm) and p_holm < FAMILY_WIDE
    equivalent = not math.isnan(test.p_equivalence) and test.p_equivalence < EQUIVALENCE_ALPHA
    if different and equivalent:
        side = "higher" if test.mean > 0 else "lower"
        return f"equivalent within ±{MARGIN}, and {side} by less than the margin"
    if different:
        return "superior" if test.mean > 0 else "inferior"
    if equivalent:
        return f"equivalent within ±{MARGIN}"
    return "inconclusive"


def family(rows: list[dict], arm: str) -> list[tuple[str, str, Test, float, str]]:
    """(metric, label, test, Holm p, verdict) of the arm's two endpoints."""
    last = continued(rows)
    tests = [
        endpoint_test(list(differences(last, arm, metric).values())) for metric, _ in ENDPOINTS
    ]
    adjusted = holm([t.p for t in tests])
    return [
        (metric, label, t, p, verdict(t, p))
        for (metric, label), t, p in zip(ENDPOINTS, tests, adjusted, strict=True)
    ]


def answer(found: list[tuple[str, str, Test, float, str]], arm: str = "DEL at α = 0.1") -> str:
    """The experiment's answer from its endpoints' verdicts (`family`): better or worse
    where a test says so (Holm), equal where every endpoint is equivalent, else none."""
    found = [f for f in found if f[2].n >= MIN_PAIRS]
    if not found:
        return f"no answer: fewer than {MIN_PAIRS} bases"
    better = [label for _, label, t, p, _ in found if p < FAMILY_WIDE and t.mean > 0]
    worse = [label for _, label, t, p, _ in found if p < FAMILY_WIDE and t.mean < 0]
    equal = [label for _, label, *_, said in found if said.startswith("equivalent")]
    if better and worse:
        return (
            f"{arm} is better than MLE on {' and '.join(better)} and worse on {' and '.join(worse)}"
        )
    if len(equal) == len(found):
        said = f"{arm} equals MLE within ±{MARGIN} on every primary endpoint"
        if better or worse:
            side = "better" if better else "worse"
            said += f", and is {side} by less than the margin on {' and '.join(better + worse)}"
        return said
    if better:
        return f"{arm} beats MLE on {' and '.join(better)}"
    if worse:
        return f"{arm} is worse than MLE on {' and '.join(worse)}"
    return f"no answer at this power: {arm} is neither shown different from MLE nor equivalent"


# ---- the page ----------------------------------------------------------------------------


def _f(value: float, spec: str = "+.4f") -> str:
    return "–" if math.isnan(value) else format(value, spec)


def _pm(value: float) -> str:
    return "–" if math.isnan(value) else f"±{value:.4f}"


def family_table(found: list[tuple[str, str, Test, float, str]]) -> str:
    lines = [
        "| endpoint | bases | mean difference [95% t interval] | SD | p (two-sided) | Holm p | "
        f"TOST p (±{MARGIN}) | sign-flip p | detectable at {POWER:.0%} | provable margin | "
        "verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, label, t, p_holm, said in found:
        lines.append(
            f"| {label} | {t.n} | {_f(t.mean)} [{_f(t.low)}, {_f(t.high)}] | {_f(t.sd, '.4f')} | "
            f"{_f(t.p, '.3f')} | {_f(p_holm, '.3f')} | {_f(t.p_equivalence, '.3g')} | "
            f"{_f(t.p_sign_flip, '.3f')} | {_pm(t.detectable)} | "
            f"{_pm(t.provable_margin)} | **{said}** |"
        )
    return "\n".join(lines) + "\n"


def planned_table() -> str:
    lines = [
        "| arm | endpoint | earlier SD (upper 80% limit) | detectable, planned | "
        "provable margin, planned |",
        "|---|---|---|---|---|",
    ]
    for (arm, metric), p in PLANNED.items():
        label = dict(ENDPOINTS)[metric]
        lines.append(
            f"| {arm} | {label} | {p['sd']:.4f} ({p['sd_upper']:.4f}) | "
            f"±{p['detectable']:.4f} (±{p['detectable_upper']:.4f}) | "
            f"±{p['provable_margin']:.4f} (±{p['provable_margin_upper']:.4f}) |"
        )
    return "\n".join(lines) + "\n"


def exploratory_table(rows: list[dict]) -> str:
    """Each arm minus MLE, paired by base, 95% t interval: pooled over ROOM_TASKS and per
    task, on the two endpoints and greedy exact match."""
    last = continued(rows)
    tasks = sorted({r["task"] for r in last})
    lines = ["| comparison | pooled (room tasks) | " + " | ".join(tasks) + " |"]
    lines.append("|---|---|" + "---|" * len(tasks))
    for arm in (PRIMARY_ARM, SECONDARY_ARM):
        for metric, label in (*ENDPOINTS, GREEDY):
            cells = []
            for columns in [ROOM_TASKS] + [(t,) for t in tasks]:
                i = t_interval(list(differences(last, arm, metric, columns).values()))
                mark = " ✱" if i.excludes_zero else ""
                cells.append(
                    f"{_f(i.mean, '+.3f')} [{_f(i.low, '+.3f')}, {_f(i.high, '+.3f')}]{mark}"
                )
            lines.append(f"| {arm} − mle, {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def long_table(rows: list[dict]) -> str:
    """The long continuations (kinds ARM@STEPS) beside the same base's 300-step ones."""
    evaluated = [r for r in rows if r["task"] != "_train" and "@" in r["kind"]]
    if not evaluated:
        return "(no long continuation in this run)\n"
    steps = evaluated[0]["step"]
    seeds = sorted({r["seed"] for r in evaluated})
    short = [r for r in continued(rows) if r["seed"] in seeds]
    lines = [
        "| arm | " + " | ".join(f"{label}, 300 → {steps}" for _, label in ENDPOINTS) + " |",
        "|---|" + "---|" * len(ENDPOINTS),
    ]
    for arm in (BASELINE, PRIMARY_ARM, SECONDARY_ARM):
        cells = []
        for metric, _ in ENDPOINTS:
            a = statistics.fmean(pooled(short, arm, metric).values() or [math.nan])
            b = statistics.fmean(pooled(evaluated, f"{arm}@{steps}", metric).values() or [math.nan])
            cells.append(f"{_f(a, '.3f')} → {_f(b, '.3f')}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def greedy_coverage(rows: list[dict], heldout: int | None) -> str:
    """Whether greedy exact match was measured on every held-out problem."""
    counts = {r.get("greedy_problems") for r in continued(rows)}
    if heldout is not None and counts == {heldout}:
        return f"Greedy exact match was measured on every held-out problem ({heldout} a task)."
    measured = sorted(c for c in counts if c is not None)
    return f"Greedy answers per task: {measured} (held-out problems a task: {heldout})."


def report(rows: list[dict], recorded: dict) -> str:
    """The page; date, machine and commit as recorded when the run ended (protocol.json)."""
    protocol = recorded["protocol"]
    primary = family(rows, PRIMARY_ARM)
    secondary = family(rows, SECONDARY_ARM)
    said = answer(primary)
    said_si = answer(secondary, "the shift-invariant DEL at α = 0.1")
    minutes, machine = recorded["minutes"], recorded["machine"]
    took = "" if math.isnan(minutes) else f"{minutes:.0f} minutes on "
    bases = sorted({r["seed"] for r in continued(rows)})
    sentences = "\n".join(
        f"* {label}: DEL at α = 0.1 minus MLE {_f(t.mean)} (95% interval {_f(t.low)} to "
        f"{_f(t.high)}, {t.n} bases): **{v}** (Holm p {_f(p, '.3f')}, TOST p "
        f"{_f(t.p_equivalence, '.3g')}); this run detects {_pm(t.detectable)} and "
        f"establishes equivalence within {_pm(t.provable_margin)} at {POWER:.0%} power."
        for _, label, t, p, v in primary
    )
    return f"""# Confirmatory: does DEL at α = 0.1 beat MLE, or equal it within ±{MARGIN}?

`{recorded["command"]}`, {recorded["date"]}, {took}{machine}, commit {recorded["commit"]}.

Protocol: {json.dumps({k: v for k, v in protocol.items() if k != "arms"})}; arms:
{", ".join(a["name"] for a in protocol.get("arms", []))}.

Pre-registered in [preregistration.md](preregistration.md) (committed before the run) and
in the module docstring of `experiments/confirmatory/report.py`. {len(bases)} bases (MLE to
step {protocol.get("base_steps")}, one per seed), each continued {protocol.get("steps")}
steps by every arm on one data order per base. Endpoints pooled with equal weight over the
tasks with room to improve: {", ".join(ROOM_TASKS)}.
{greedy_coverage(rows, protocol.get("heldout"))}
Recompute everything from raw_runs.jsonl: `python -m experiments.confirmatory.report
raw_runs.jsonl --out DIR`.

## Answer

**{said[0].upper() + said[1:]}.**

{sentences}

## Primary: DEL at α = 0.1 minus MLE, paired by base

Superiority: two-sided paired t, Holm over the two endpoints at {FAMILY_WIDE}. Equivalence:
two one-sided tests at ±{MARGIN}, each at {EQUIVALENCE_ALPHA} (the 95% interval inside
±{MARGIN}). "Detectable" is the smallest true difference the t test finds with {POWER:.0%}
power at Holm's first level ({FAMILY_WIDE / len(ENDPOINTS)}); "provable margin" the smallest
margin TOST establishes with {POWER:.0%} power when the truth is 0; both from this run's own
spread.

{family_table(primary)}
Before the run, from the earlier continuation run's spread (4 bases; planned for
{PLANNED_BASES} bases):

{planned_table()}
## Secondary: the shift-invariant DEL at α = 0.1 (ours) minus MLE

The same tests, a family of its own: **{said_si[0].upper() + said_si[1:]}.**

{family_table(secondary)}
## Exploratory (leads, not findings)

Each arm minus MLE, paired by base, mean [95% t interval]; ✱: the interval excludes 0
(uncorrected). Greedy exact match is the secondary outcome the issue asks for: every
held-out problem answered by greedy decoding.

{exploratory_table(rows)}
### The long continuations (one base, no test)

{long_table(rows)}
### The digit logits' level (mean over bases, first and last logged step)

{level_table([r for r in rows if "@" not in r["kind"]])}"""


def write_outputs(rows: list[dict], out: Path, recorded: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "report.md", report(rows, recorded))
    return out / "report.md"


def write_report(
    runs: Iterable[dict], out: Path, *, protocol: dict, command: str, minutes: float
) -> Path:
    """raw_runs.jsonl and protocol.json (with the run's date, machine and commit), then the
    page from them."""
    return record_run(runs, out, protocol, command, minutes, write_outputs)


def main(argv: list[str] | None = None) -> int:
    return report_main(argv, __doc__.splitlines()[0], "confirmatory report", write_outputs)


if __name__ == "__main__":
    raise SystemExit(main())
