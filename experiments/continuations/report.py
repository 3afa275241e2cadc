"""The continuation experiment's analysis and page (`run`), fixed before the full run and
recomputed from its raw rows alone:

    python -m experiments.continuations.report RAW_ROWS.jsonl --out DIR

**Pre-registered** (committed before the full run; docs/results/continuations/): the PRIMARY
endpoints below, each at the continuations' last step; for each, the DEL arm's trend in
log10(alpha) over alpha in {0.1, 0.3, 1, 3}, with one intercept per base (a linear model
y = b_seed + beta * log10(alpha) + e, ordinary least squares), tested two-sided with Student t
at n - seeds - 1 degrees of freedom; the seven p-values Holm-corrected at 5%. Everything else
(the shift-invariant arm's trend, each arm's difference to the MLE continuation paired by
base, the placebo) is exploratory: a lead, never a finding. Power: the smallest slope this
design detects at 80% power at Holm's strictest level (0.05 / 7), from each endpoint's own
residual spread.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from del_megatron.errors import UserError
from del_megatron.outputs import write_text_atomic

from ..effects import holm, paired_differences, t_interval
from ..numeric_tasks.report import read_raw  # the same raw-row format: one JSON object a line

# (task, metric, label, the direction DEL's claim predicts): the pre-registered endpoints
PRIMARY = (
    ("add", "entropy_gap", "add: digit entropy minus the true entropy", "down"),
    ("subtract", "entropy_gap", "subtract: digit entropy minus the true entropy", "down"),
    ("multiply", "entropy_gap", "multiply: digit entropy minus the true entropy", "down"),
    ("add", "digit_acc", "add: digit accuracy", "up"),
    ("subtract", "digit_acc", "subtract: digit accuracy", "up"),
    ("multiply", "digit_acc", "multiply: digit accuracy", "up"),
    ("noisy", "answer_loss", "noisy scale: answer cross-entropy against the truth", "down"),
)
FAMILY_WIDE = 0.05  # Holm's family-wise error rate
# Fewer residual degrees of freedom give no test: with 2 bases and 2 alphas a discrete metric
# often fits exactly (a zero standard error, an infinite t) and says nothing.
MIN_DF = 3
POWER = 0.8
BASELINE = "mle"
EXPLORATORY_METRICS = (  # (metric, label, format)
    ("digit_acc", "digit accuracy", "+.3f"),
    ("entropy_gap", "entropy gap (nats)", "+.3f"),
    ("answer_loss", "answer CE (nats)", "+.3f"),
    ("digit_ece", "ECE", "+.3f"),
    ("exact_greedy", "exact (greedy)", "+.3f"),
    ("number_mae", "number MAE", "+.3g"),
)
LEVEL_KEYS = ("digit_logsumexp", "digit_logit", "numeric", "ce", "digit_entropy")


@dataclass(frozen=True)
class Trend:
    slope: float  # per decade of alpha
    se: float
    df: int
    p: float
    mde: float  # the smallest |slope| detected at POWER at Holm's strictest level
    n: int

    @property
    def t(self) -> float:
        return self.slope / self.se if self.se > 0 else math.nan


def trend(points: list[tuple[int, float, float]], tests: int) -> Trend:
    """points: (seed, log10 alpha, y). OLS of y on log10 alpha with one intercept per seed:
    x and y centred within each seed, slope = sum(xc yc) / sum(xc^2)."""
    from scipy.stats import t as student

    points = [p for p in points if not math.isnan(p[2])]
    by_seed: dict[int, list[tuple[float, float]]] = {}
    for seed, x, y in points:
        by_seed.setdefault(seed, []).append((x, y))
    centred = []
    for values in by_seed.values():
        mx = statistics.fmean(x for x, _ in values)
        my = statistics.fmean(y for _, y in values)
        centred += [(x - mx, y - my) for x, y in values]
    n, df = len(points), len(points) - len(by_seed) - 1
    sxx = sum(x * x for x, _ in centred)
    if df < 1 or sxx == 0:
        return Trend(math.nan, math.nan, df, math.nan, math.nan, n)
    slope = sum(x * y for x, y in centred) / sxx
    residual = sum((y - slope * x) ** 2 for x, y in centred) / df
    se = math.sqrt(residual / sxx)
    if df < MIN_DF or se == 0:  # no spread left to test against
        return Trend(slope, se, df, math.nan, math.nan, n)
    p = 2 * student.sf(abs(slope / se), df)
    strictest = FAMILY_WIDE / tests
    mde = (student.ppf(1 - strictest / 2, df) + student.ppf(POWER, df)) * se
    return Trend(slope, se, df, float(p), float(mde), n)


# ---- raw rows ----------------------------------------------------------------------------

TRAIN_EVERY = 25  # the training rows kept: step 1 and every this many (metrics.jsonl has all)


def raw_rows(runs: list[dict]) -> list[dict]:
    """One row per run and task at its evaluated step (every scalar measured), and one per
    run and logged training step (task '_train')."""
    rows = []
    for run in runs:
        try:
            head = {
                "kind": run["kind"],
                "loss_kind": run["loss_kind"],
                "family": run["family"],
                "alpha": run["alpha"],
                "seed": run["seed"],
            }
            for point in run["curve"]:
                for task, values in point["tasks"].items():
                    kept = {k: v for k, v in values.items() if isinstance(v, int | float | str)}
                    rows.append({**head, "step": point["step"], "task": task, **kept})
            for point in run["train_curve"]:
                if point["step"] == 1 or point["step"] % TRAIN_EVERY == 0:
                    rows.append({**head, "task": "_train", **point})
        except (KeyError, TypeError, AttributeError) as err:
            raise UserError(f"a run's metrics lack {err}") from None
    return rows


def _last(rows: list[dict]) -> list[dict]:
    """The continuations' evaluated rows at their last step."""
    evaluated = [r for r in rows if r["task"] != "_train" and r["kind"] != "base"]
    last = max(r["step"] for r in evaluated)
    return [r for r in evaluated if r["step"] == last]


def _value(rows: list[dict], kind: str, task: str, metric: str) -> dict[int, float]:
    return {
        r["seed"]: float(r[metric])
        for r in rows
        if r["kind"] == kind and r["task"] == task and metric in r
    }


def trends(rows: list[dict], family: str) -> list[tuple[tuple, Trend]]:
    last = _last(rows)
    out = []
    for endpoint in PRIMARY:
        task, metric = endpoint[0], endpoint[1]
        points = [
            (r["seed"], math.log10(r["alpha"]), float(r[metric]))
            for r in last
            if r["family"] == family and r["task"] == task and metric in r
        ]
        out.append((endpoint, trend(points, len(PRIMARY))))
    return out


def _fmt(value: float, spec: str) -> str:
    return "–" if math.isnan(value) else format(value, spec)


def trend_table(rows: list[dict], family: str) -> tuple[str, list[str]]:
    """The table of one family's trends, and the endpoints that survive Holm, each said with
    its sign against the one DEL's claim predicts (PRIMARY)."""
    found = trends(rows, family)
    adjusted = holm([t.p for _, t in found])
    lines = [
        "| endpoint | slope per decade of α | SE | t (df) | p | Holm p | detectable at 80% |",
        "|---|---|---|---|---|---|---|",
    ]
    survive = []
    for ((_, _, label, predicted), t), p_holm in zip(found, adjusted, strict=True):
        mark = " **✱**" if p_holm < FAMILY_WIDE else ""
        if mark:
            sign = "up" if t.slope > 0 else "down"
            side = "as DEL's claim predicts" if sign == predicted else "against DEL's claim"
            survive.append(f"{label} ({sign} with α, {side})")
        lines.append(
            f"| {label} | {_fmt(t.slope, '+.4f')}{mark} | {_fmt(t.se, '.4f')} | "
            f"{_fmt(t.t, '+.2f')} ({t.df}) | {_fmt(t.p, '.3f')} | {_fmt(p_holm, '.3f')} | "
            f"±{_fmt(t.mde, '.4f')} |"
        )
    return "\n".join(lines) + "\n", survive


def differences(rows: list[dict]) -> str:
    """Every arm against the MLE continuation, paired by base: 95% t intervals."""
    last = _last(rows)
    kinds = [k for k in dict.fromkeys(r["kind"] for r in last) if k != BASELINE]
    tasks = sorted({r["task"] for r in last})
    out = []
    for metric, label, spec in EXPLORATORY_METRICS:
        out.append(f"### {label}\n\n| arm | " + " | ".join(tasks) + " |")
        out.append("|---|" + "---|" * len(tasks))
        for kind in kinds:
            cells = []
            for task in tasks:
                arm, base = _value(last, kind, task, metric), _value(last, BASELINE, task, metric)
                diffs = [arm[s] - base[s] for s in sorted(arm) if s in base]
                interval = t_interval(diffs)
                mark = " ✱" if interval.excludes_zero else ""
                cells.append(
                    f"{_fmt(interval.mean, spec)} [{_fmt(interval.low, spec)}, "
                    f"{_fmt(interval.high, spec)}]{mark}"
                )
            out.append(f"| {kind} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def level_table(rows: list[dict]) -> str:
    """The digit logits' level and the term at the continuations' first and last logged
    step, mean over bases."""
    train = [r for r in rows if r["task"] == "_train" and r["kind"] != "base"]
    if not train:
        return "(no training metrics)\n"
    first, last = min(r["step"] for r in train), max(r["step"] for r in train)
    lines = [
        f"| arm | log-sum-exp at digits, step {first} → {last} | mean digit logit | "
        "numeric term | CE | digit entropy |",
        "|---|---|---|---|---|---|",
    ]
    for kind in dict.fromkeys(r["kind"] for r in train):
        cells = []
        for key in LEVEL_KEYS:
            at = {
                step: [
                    float(r[key])
                    for r in train
                    if r["kind"] == kind and r["step"] == step and key in r
                ]
                for step in (first, last)
            }
            a, b = (statistics.fmean(v) if v else math.nan for v in (at[first], at[last]))
            cells.append(f"{_fmt(a, '.3f')} → {_fmt(b, '.3f')}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def escape_table(rows: list[dict]) -> tuple[str, str]:
    """Each DEL arm against the MLE continuation at the last logged training step, paired
    by base: CE and the digit entropy (95% t intervals), and the term's share of the
    gradient at the logits and its cosine with CE's (mean over bases); then what it says."""
    train = [r for r in rows if r["task"] == "_train" and r["kind"] != "base"]
    kinds = [k for k in dict.fromkeys(r["kind"] for r in train) if k.startswith("del")]
    if not kinds:
        return "(no DEL arm)\n", ""
    last = max(r["step"] for r in train)
    at = [r for r in train if r["step"] == last]
    lines = [
        f"| arm | CE − MLE's, step {last} | digit entropy − MLE's | term's share of the "
        "logit gradient | its cosine with CE's |",
        "|---|---|---|---|---|",
    ]
    excluded = []
    for kind in kinds:
        cells = []
        for key in ("ce", "digit_entropy"):
            i = t_interval(
                paired_differences(
                    _value(at, kind, "_train", key), _value(at, BASELINE, "_train", key)
                )
            )
            mark = " ✱" if i.excludes_zero else ""
            if mark:
                excluded.append(f"{kind} {key.replace('_', ' ')}")
            cells.append(
                f"{_fmt(i.mean, '+.3f')} [{_fmt(i.low, '+.3f')}, {_fmt(i.high, '+.3f')}]{mark}"
            )
        for key in ("numeric_grad_share", "numeric_grad_cos"):
            values = list(_value(at, kind, "_train", key).values())
            cells.append(_fmt(statistics.fmean(values), "+.3f") if values else "–")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    escaped = [e for e in excluded if e.startswith("del-")]  # the DEL arms, not del_si
    tested = 2 * sum(k.startswith("del-") for k in kinds)
    said = (
        f"At step {last}, {len(excluded)} of {2 * len(kinds)} paired intervals of CE and the "
        "digit entropy against MLE exclude 0 ("
        + (", ".join(excluded) or "none")
        + "); "
        + (
            f"{len(escaped)} of the {tested} of the DEL arms (whose term is escaped) do: the "
            "escape does not leave CE and the digit entropy where MLE leaves them."
            if escaped
            else "none of the DEL arms' (whose term is escaped) do."
        )
        + " The share and cosine come from the log-step gradient probe, untested."
    )
    return "\n".join(lines) + "\n", said


def shift_invariant_against_del(rows: list[dict], metric: str = "entropy_gap") -> str:
    """The shift-invariant DEL minus DEL, paired by base, averaged over the alphas both
    ran, per primary task: does closing the escape change the size?"""
    last = _last(rows)
    alphas = sorted(
        {r["alpha"] for r in last if r["family"] == "del"}
        & {r["alpha"] for r in last if r["family"] == "del_shift_invariant"}
    )
    tasks = list(dict.fromkeys(task for task, *_ in PRIMARY if task != "noisy"))
    if not alphas:
        return ""
    cells, wider = [], []
    for task in tasks:
        by_base: dict[int, list[float]] = {}
        for alpha in alphas:
            si = {
                r["seed"]: float(r[metric])
                for r in last
                if r["family"] == "del_shift_invariant"
                and r["alpha"] == alpha
                and r["task"] == task
                and metric in r
            }
            de = {
                r["seed"]: float(r[metric])
                for r in last
                if r["family"] == "del"
                and r["alpha"] == alpha
                and r["task"] == task
                and metric in r
            }
            for seed in si.keys() & de.keys():
                by_base.setdefault(seed, []).append(si[seed] - de[seed])
        i = t_interval([statistics.fmean(v) for v in by_base.values() if len(v) == len(alphas)])
        if i.excludes_zero:
            wider.append(task)
        cells.append(
            f"{task} {_fmt(i.mean, '+.3f')} [{_fmt(i.low, '+.3f')}, {_fmt(i.high, '+.3f')}]"
        )
    return (
        f"The shift-invariant DEL minus DEL, {metric.replace('_', ' ')} averaged over "
        f"α = {', '.join(f'{a:g}' for a in alphas)}, paired by base (95% t interval): "
        + "; ".join(cells)
        + f". The interval excludes 0 on {len(wider)} of {len(tasks)} tasks"
        + (f" ({', '.join(wider)})" if wider else "")
        + ": a lead, not corrected.\n"
    )


def control_sentences(rows: list[dict]) -> str:
    """Counts the page's tables hold, said: the placebo's intervals excluding 0, and on how
    many tasks DEL's mean number MAE rises at every step of α (untested)."""
    last = _last(rows)
    tasks = sorted({r["task"] for r in last})
    said = []
    if any(r["kind"] == "placebo" for r in last):
        outside = [
            f"{task} {label}"
            for metric, label, _ in EXPLORATORY_METRICS
            for task in tasks
            if t_interval(
                paired_differences(
                    _value(last, "placebo", task, metric), _value(last, BASELINE, task, metric)
                )
            ).excludes_zero
        ]
        said.append(
            f"The placebo's intervals exclude 0 in {len(outside)} of "
            f"{len(EXPLORATORY_METRICS) * len(tasks)} cells ({', '.join(outside) or 'none'}): "
            "what a trivial nudge moves."
        )
    alphas = sorted({r["alpha"] for r in last if r["family"] == "del"})
    rising = []
    for task in tasks:
        means = [
            statistics.fmean(
                [
                    float(r["number_mae"])
                    for r in last
                    if r["family"] == "del"
                    and r["alpha"] == a
                    and r["task"] == task
                    and "number_mae" in r
                ]
                or [math.nan]
            )
            for a in alphas
        ]
        if len(means) > 1 and all(b > a for a, b in itertools.pairwise(means)):
            rising.append(task)
    if len(alphas) > 1:
        said.append(
            f"DEL's mean number MAE rises at every step of α on {len(rising)} of {len(tasks)} "
            f"tasks ({', '.join(rising) or 'none'}); untested (a lead)."
        )
    return " ".join(said) + "\n"


def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    train = [r for r in rows if r["task"] == "_train" and r["kind"] != "base"]
    shown = [
        k
        for k in ("mle", "del-0.1", "del-1", "del-3", "del_si-1", "del_si-3")
        if any(r["kind"] == k for r in train)
    ]
    if train:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for key, ax in zip(("digit_logsumexp", "numeric", "digit_entropy"), axes, strict=True):
            for kind in shown:
                steps = sorted({r["step"] for r in train if r["kind"] == kind})
                means = [
                    statistics.fmean(
                        float(r[key])
                        for r in train
                        if r["kind"] == kind and r["step"] == s and key in r
                    )
                    if any(r["kind"] == kind and r["step"] == s and key in r for r in train)
                    else math.nan
                    for s in steps
                ]
                ax.plot(steps, means, label=kind)
            ax.set_xlabel("continuation step")
            ax.set_title(key)
        axes[0].legend(fontsize=8)
        path = out / "logit_level.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    last = _last(rows)
    fig, axes = plt.subplots(1, len(PRIMARY), figsize=(3.2 * len(PRIMARY), 3.4))
    for (task, metric, label, _), ax in zip(PRIMARY, axes, strict=True):
        base = _value(last, BASELINE, task, metric)
        for family, marker in (("del", "o"), ("del_shift_invariant", "s")):
            alphas = sorted({r["alpha"] for r in last if r["family"] == family})
            xs, ms, lo, hi = [], [], [], []
            for alpha in alphas:
                arm = {
                    r["seed"]: float(r[metric])
                    for r in last
                    if r["family"] == family and r["alpha"] == alpha and r["task"] == task
                }
                interval = t_interval([arm[s] - base[s] for s in arm if s in base])
                xs.append(alpha)
                ms.append(interval.mean)
                lo.append(interval.mean - interval.low if not math.isnan(interval.low) else 0)
                hi.append(interval.high - interval.mean if not math.isnan(interval.high) else 0)
            if xs:
                ax.errorbar(xs, ms, yerr=[lo, hi], marker=marker, capsize=3, label=family)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(label.replace(": ", ":\n"), fontsize=8)
        ax.set_xlabel("α")
    axes[0].set_ylabel("difference to the MLE continuation")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "dose_response.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def report(
    rows: list[dict],
    *,
    protocol: dict,
    command: str,
    minutes: float,
    date: str,
    machine: str,
    commit: str,
) -> str:
    """The page; date, machine and commit as recorded when the runs were made
    (protocol.json), so that the page regenerates from its raw rows to the byte."""
    primary, survive = trend_table(rows, "del")
    secondary, leads = trend_table(rows, "del_shift_invariant")
    seeds = sorted({r["seed"] for r in rows})
    took = "" if math.isnan(minutes) else f"{minutes:.0f} minutes on "
    found = trends(rows, "del")
    decades = math.log10(30)  # alpha 0.1 to 3
    smallest = min((t.mde for _, t in found if not math.isnan(t.mde)), default=math.nan)
    largest = max((t.mde for _, t in found if not math.isnan(t.mde)), default=math.nan)
    if survive:
        verdict = (
            f"The DEL arm's trend in log α survives Holm's correction on {len(survive)} of "
            f"{len(PRIMARY)} primary endpoints: " + "; ".join(survive) + "."
        )
        if len(survive) < len(PRIMARY):
            verdict += " The others show no trend at this power (the 'detectable' column)."
    else:
        verdict = (
            "No primary endpoint's trend survives Holm's correction. This is an absence of "
            "evidence at this power, not evidence of no effect: a slope below the "
            "'detectable at 80%' column (from "
            f"{_fmt(smallest, '.4f')} to {_fmt(largest, '.4f')} per decade of α, i.e. "
            f"{_fmt(smallest * decades, '.3f')} to {_fmt(largest * decades, '.3f')} between "
            "α = 0.1 and α = 3, in each endpoint's own units) cannot be seen here."
        )
    lead_line = (
        "The shift-invariant arm's trend passes Holm within its own (exploratory) family on: "
        + "; ".join(leads)
        + " (a lead)."
        if leads
        else "No trend of the shift-invariant arm passes Holm within its own family."
    )
    escape, escape_said = escape_table(rows)
    return f"""# Continuations: can DEL move a model MLE has trained?

`{command}`, {date}, {took}{machine}, commit {commit}.

Protocol: {json.dumps({k: v for k, v in protocol.items() if k != "arms"})}; arms:
{", ".join(a["name"] for a in protocol.get("arms", []))}.

{len(seeds)} shared bases (MLE, one per seed, to step {protocol.get("base_steps")}); every
arm continues each base for {protocol.get("steps")} steps from its weights (a fresh optimizer,
as continued pretraining starts from a released model) on one data order per base. Metrics
on each task's held-out answers at the continuations' last step. Recompute everything from
raw_runs.jsonl: `python -m experiments.continuations.report raw_runs.jsonl --out DIR`.

## Pre-registered primary endpoints (DEL, trend in log10 α, Holm at 5%)

Fixed before the full run (module docstring of
`experiments/continuations/report.py`). The slope is the change per decade of α
(α = 0.1, 0.3, 1, 3) with one intercept per base; **✱** marks a Holm-adjusted p below 0.05.
"Detectable at 80%" is the smallest |slope| this design finds with 80% power at Holm's
strictest level (0.05 / {len(PRIMARY)}), from the endpoint's own residual spread.

{primary}
{verdict}

## The digit logits' level: is the term learned from or escaped?

Training metrics of the continuations (mean over bases), first and last logged step:
the log-sum-exp of the ten digit-class logits at digit positions, their mean, the numeric
term (DEL: the place-weighted supervised digit entropy, before α), CE and the digit entropy.
An escaped term falls with the logits' level; whether CE and the digit entropy stay where
MLE leaves them is measured below, paired by base (✱: the 95% interval excludes 0).

{level_table(rows)}
{escape}
{escape_said}

![logit level](logit_level.png)

## Exploratory: the shift-invariant DEL's trend (ours)

{secondary}
{lead_line}

{shift_invariant_against_del(rows)}
![dose response](dose_response.png)

## Exploratory: every arm against the MLE continuation

Paired by base, mean [95% Student t interval]; ✱: the interval excludes 0 (a lead, not
corrected for the {len(EXPLORATORY_METRICS)} metrics × tasks × arms it is one of). The
placebo (MLE at lr ×1.1) shows what a trivial nudge moves.

{control_sentences(rows)}
{differences(rows)}
"""


def write_outputs(rows: list[dict], out: Path, recorded: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out)
    page = report(
        rows,
        protocol=recorded["protocol"],
        command=recorded["command"],
        minutes=recorded["minutes"],
        date=recorded["date"],
        machine=recorded["machine"],
        commit=recorded["commit"],
    )
    write_text_atomic(out / "report.md", page)
    return out / "report.md"


def write_report(
    runs: Iterable[dict], out: Path, *, protocol: dict, command: str, minutes: float
) -> Path:
    return record_run(runs, out, protocol, command, minutes, write_outputs)


def record_run(
    runs: Iterable[dict],
    out: Path,
    protocol: dict,
    command: str,
    minutes: float,
    write_pages: Callable[[list[dict], Path, dict], Path],
) -> Path:
    """raw_runs.jsonl and protocol.json (with the run's date, machine and commit), then the
    page from them (`write_pages`, the experiment's): each experiment of this design."""
    from ..machine import provenance

    rows = raw_rows(list(runs))
    recorded = {"protocol": protocol, "command": command, "minutes": minutes, **provenance()}
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "raw_runs.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_text_atomic(out / "protocol.json", json.dumps(recorded, indent=1) + "\n")
    return write_pages(rows, out, recorded)


def main(argv: list[str] | None = None) -> int:
    return report_main(argv, __doc__.splitlines()[0], "continuation report", write_outputs)


def report_main(
    argv: list[str] | None,
    description: str,
    name: str,
    write_pages: Callable[[list[dict], Path, dict], Path],
) -> int:
    """The command that regenerates an experiment's page from its raw rows (protocol.json
    beside them): exit 2 with one line on a missing or unreadable input."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("raw", type=Path, help="raw_runs.jsonl (protocol.json beside it)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    try:
        if not a.raw.is_file():
            raise UserError(f"{a.raw}: does not exist (the raw rows, raw_runs.jsonl)")
        recorded = json.loads((a.raw.parent / "protocol.json").read_text())
        write_pages(read_raw(a.raw), a.out, recorded)
    except (UserError, OSError, json.JSONDecodeError, KeyError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
