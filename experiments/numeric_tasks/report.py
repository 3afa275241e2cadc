"""The numeric-task protocol's report from raw per-run metrics: raw_runs.jsonl (one row per
kind, seed, step and task: everything measured, so anyone can recompute the intervals),
report.md (per task and kind: final metrics over seeds, the difference to MLE with its 95%
interval paired by seed, steps to the digit-accuracy threshold) and the plots.

    python -m experiments.numeric_tasks.report RAW_RUNS_JSONL --out DIR
        (the report again from the raw rows alone)
    python -m experiments.numeric_tasks.report --evaluated KIND-SEED ... --out DIR
        (from `del-eval --tasks` results, one step a run: compare_losses_gpu.sh)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from del_megatron.errors import UserError
from del_megatron.outputs import write_text_atomic

from ..effects import (
    CONFIDENCE,
    MIN_PAIRS,
    Interval,
    benjamini_hochberg,
    holm,
    paired_differences,
    paired_effect,
    paired_p,
    steps_to_threshold,
    t_interval,
)

BASELINE = "mle"
THRESHOLD = 0.8  # of the best digit accuracy: steps-to-threshold (sample efficiency)
EFFECTS = [  # (metric, label, format): differences to MLE
    ("digit_acc", "digit accuracy", "+.3f"),
    ("exact_teacher_forced", "exact match, teacher-forced", "+.3f"),
    ("exact_greedy", "exact match, greedy", "+.3f"),
    ("number_mae", "number MAE of the greedy answers (those that are a number)", "+.3g"),
    ("entropy_gap", "digit entropy minus the true entropy (nats)", "+.3f"),
    ("digit_ece", "digit calibration error (ECE)", "+.3f"),
]
FINAL = [  # (metric, label): the final step's values over seeds
    ("digit_acc", "digit acc"),
    ("exact_teacher_forced", "exact (TF)"),
    ("exact_greedy", "exact (greedy)"),
    ("number_mae", "number MAE"),
    ("digit_entropy", "digit entropy"),
    ("digit_ece", "ECE"),
]
KEYS = ("kind", "seed", "step", "task")


def read_runs(metrics_files: Iterable[Path]) -> list[dict]:
    """The runs' metrics.json files ({kind, seed, curve: [{step, tasks}]})."""
    runs = []
    for path in metrics_files:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UserError(f"{path}: not a run's metrics ({err})") from None
    return runs


def run_of_evaluation(directory: Path) -> dict:
    """A run in the protocol's form from `del-eval --tasks` results in `directory` (named
    KIND-SEED, as launch/experiments/compare_losses_gpu.sh names them; the step read from
    the evaluated checkpoint's name, 0 for another model)."""
    from del_megatron.evaluation.compare import group_name, read_results

    results = read_results(directory)
    if not isinstance(results.get("tasks"), dict):
        raise UserError(f"{directory}/results.json: no task metrics (evaluate with --tasks)")
    kind, seed = group_name(directory, "parent-name"), directory.name.rsplit("-", 1)[-1]
    if not (kind != directory.name and seed.isdigit()):
        raise UserError(f"{directory}: not named KIND-SEED")
    step_name = Path(str(results.get("model", ""))).name
    step = int(step_name[5:]) if step_name.startswith("step-") and step_name[5:].isdigit() else 0
    return {"kind": kind, "seed": int(seed), "curve": [{"step": step, "tasks": results["tasks"]}]}


def raw_rows(runs: list[dict]) -> list[dict]:
    """One row per kind, seed, step and task (every scalar measured)."""
    rows = []
    for run in runs:
        try:
            for point in run["curve"]:
                for task, values in point["tasks"].items():
                    kept = {k: v for k, v in values.items() if isinstance(v, int | float | str)}
                    rows.append(
                        {
                            "kind": run["kind"],
                            "seed": run["seed"],
                            "step": point["step"],
                            "task": task,
                            **kept,
                        }
                    )
        except (KeyError, TypeError, AttributeError) as err:
            raise UserError(f"a run's metrics lack {err}") from None
    return rows


def read_raw(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
            if not all(k in row for k in KEYS):
                raise KeyError(f"one of {KEYS}")
        except (json.JSONDecodeError, KeyError) as err:
            raise UserError(f"{path} line {number}: not a raw row ({err})") from None
        rows.append(row)
    return rows


def _order(values: Iterable) -> list:
    return sorted(set(values), key=lambda v: (v != BASELINE, str(v)))


def by_seed(rows: list[dict], kind: str, task: str, step: int, metric: str) -> dict[int, float]:
    return {
        r["seed"]: float(r[metric])
        for r in rows
        if r["kind"] == kind and r["task"] == task and r["step"] == step and metric in r
    }


def effects(rows: list[dict], metric: str) -> dict[tuple[str, str], Interval]:
    """{(task, kind): the kind's difference to MLE at the last step, paired by seed}."""
    last = max(r["step"] for r in rows)
    out = {}
    for task in _order(r["task"] for r in rows):
        baseline = by_seed(rows, BASELINE, task, last, metric)
        for kind in _order(r["kind"] for r in rows):
            if kind != BASELINE:
                out[task, kind] = paired_effect(by_seed(rows, kind, task, last, metric), baseline)
    return out


def _cell(interval: Interval, fmt: str) -> str:
    if math.isnan(interval.mean):
        return "—"
    if math.isnan(interval.low):
        return f"{interval.mean:{fmt}} (n={interval.n})"
    mark = " **✱**" if interval.excludes_zero else ""
    return f"{interval.mean:{fmt}} [{interval.low:{fmt}}, {interval.high:{fmt}}]{mark}"


def final_table(rows: list[dict]) -> str:
    last = max(r["step"] for r in rows)
    kinds = _order(r["kind"] for r in rows)
    lines = []
    for task in _order(r["task"] for r in rows):
        sample = next(r for r in rows if r["task"] == task)
        lines += [
            f"**{task}** ({sample.get('level', '')}; true digit entropy "
            f"{sample.get('true_digit_entropy', math.nan):.3f} nats, best digit accuracy "
            f"{sample.get('best_digit_acc', math.nan):.3f})",
            "",
            "| kind | n | " + " | ".join(label for _, label in FINAL) + " |",
            "|---|---|" + "---|" * len(FINAL),
        ]
        for kind in kinds:
            cells, n = [], 0
            for metric, _ in FINAL:
                values = list(by_seed(rows, kind, task, last, metric).values())
                n = max(n, len(values))
                if values:
                    spread = statistics.stdev(values) if len(values) > 1 else 0.0
                    cells.append(f"{statistics.fmean(values):.3f} ± {spread:.3f}")
                else:
                    cells.append("—")
            lines.append(f"| {kind} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


FAMILY_WIDE = 0.05  # Holm's family-wise error rate and Benjamini-Hochberg's false discoveries


def corrected(rows: list[dict]) -> tuple[list[str], list[str], int]:
    """The differences to MLE that survive a correction for every interval tested (from
    MIN_PAIRS pairs): (Holm at FAMILY_WIDE, Benjamini-Hochberg at FAMILY_WIDE, tests)."""
    last = max(r["step"] for r in rows)
    kinds = [k for k in _order(r["kind"] for r in rows) if k != BASELINE]
    cells, p_values = [], []
    for metric, label, fmt in EFFECTS:
        for task in _order(r["task"] for r in rows):
            baseline = by_seed(rows, BASELINE, task, last, metric)
            for kind in kinds:
                diffs = paired_differences(by_seed(rows, kind, task, last, metric), baseline)
                diffs = [d for d in diffs if not math.isnan(d)]
                if len(diffs) < MIN_PAIRS:
                    continue
                cells.append((kind, task, label, fmt, t_interval(diffs)))
                p_values.append(paired_p(diffs))
    said = [
        [
            f"{kind} vs mle on {task}, {label}: {_cell(interval, fmt)} (adjusted p {p:.3f})"
            for (kind, task, label, fmt, interval), p in zip(cells, adjusted, strict=True)
            if p < FAMILY_WIDE
        ]
        for adjusted in (holm(p_values), benjamini_hochberg(p_values))
    ]
    return said[0], said[1], len(p_values)


POWER = 0.8
POWER_KIND = "del"  # the kind the project is about: what its comparison with MLE can see


def power_table(rows: list[dict], kind: str = POWER_KIND) -> str:
    """Per task: the half-width of `kind`'s 95% interval against MLE, and the smallest true
    difference a paired t test at 5% (uncorrected) finds with POWER, from the observed
    spread of the paired differences: (t_0.975 + t_POWER) * sd / sqrt(n)."""
    from scipy.stats import t

    if kind not in {r["kind"] for r in rows}:
        return ""
    last = max(r["step"] for r in rows)
    metrics = [(m, label, fmt) for m, label, fmt in EFFECTS if m in ("digit_acc", "entropy_gap")]
    lines = [
        "| task | " + " | ".join(f"{label}: ± 95% / detectable" for _, label, _ in metrics) + " |",
        "|---|" + "---|" * len(metrics),
    ]
    for task in _order(r["task"] for r in rows):
        cells = []
        for metric, _, _ in metrics:
            diffs = paired_differences(
                by_seed(rows, kind, task, last, metric), by_seed(rows, BASELINE, task, last, metric)
            )
            diffs = [d for d in diffs if not math.isnan(d)]
            if len(diffs) < 2:
                cells.append("—")
                continue
            n, se = len(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
            half = t.ppf(0.5 + CONFIDENCE / 2, n - 1) * se
            detectable = (t.ppf(0.5 + CONFIDENCE / 2, n - 1) + t.ppf(POWER, n - 1)) * se
            cells.append(f"±{half:.3f} / {detectable:.3f}")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def effect_tables(rows: list[dict]) -> tuple[str, list[str], int]:
    """The markdown tables of differences to MLE, one line per interval excluding 0, and how
    many intervals could (from MIN_PAIRS pairs)."""
    kinds = [k for k in _order(r["kind"] for r in rows) if k != BASELINE]
    tasks = _order(r["task"] for r in rows)
    lines, notes, tested = [], [], 0
    for metric, label, fmt in EFFECTS:
        table = effects(rows, metric)
        lines += [
            f"**{label}**, kind minus MLE",
            "",
            "| task | " + " | ".join(kinds) + " |",
            "|---|" + "---|" * len(kinds),
        ]
        for task in tasks:
            lines.append(
                f"| {task} | " + " | ".join(_cell(table[task, k], fmt) for k in kinds) + " |"
            )
            notes += [
                f"{kind} vs mle on {task}, {label}: {_cell(table[task, kind], fmt)}"
                for kind in kinds
                if table[task, kind].excludes_zero
            ]
            tested += sum(table[task, k].testable for k in kinds)
        lines.append("")
    return "\n".join(lines), notes, tested


def curve(
    rows: list[dict], kind: str, seed: int, task: str, metric: str
) -> list[tuple[int, float]]:
    return sorted(
        (r["step"], float(r[metric]))
        for r in rows
        if r["kind"] == kind and r["seed"] == seed and r["task"] == task
    )


def threshold_table(rows: list[dict], threshold: float = THRESHOLD) -> str:
    """Per task and kind: the mean over seeds of the first evaluated step whose digit
    accuracy reaches `threshold` of the best any model can (1 for exact tasks), among the
    seeds that reach it (k/n of them)."""
    kinds = _order(r["kind"] for r in rows)
    lines = ["| task | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for task in _order(r["task"] for r in rows):
        cells = []
        for kind in kinds:
            seeds = sorted({r["seed"] for r in rows if r["kind"] == kind})
            steps = [
                steps_to_threshold(curve(rows, kind, s, task, "relative_digit_acc"), threshold)
                for s in seeds
            ]
            reached = [s for s in steps if s is not None]
            cells.append(
                f"{statistics.fmean(reached):.0f} ({len(reached)}/{len(seeds)})"
                if reached
                else f"— (0/{len(seeds)})"
            )
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _save(fig, axes, path: Path) -> Path:
    import matplotlib.pyplot as plt

    if axes.flat[0].get_legend_handles_labels()[1]:  # kinds besides MLE to name
        axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: list[dict], out: Path) -> list[Path]:
    """curves.png (digit accuracy against step, mean and 95% band over seeds, per task),
    effects.png (differences to MLE with intervals, per metric), entropy.png (digit entropy
    per kind against the true entropy, per task)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds, tasks = _order(r["kind"] for r in rows), _order(r["task"] for r in rows)
    steps = sorted({r["step"] for r in rows})
    cols = 4
    grid = (math.ceil(len(tasks) / cols), cols)
    written = []

    fig, axes = plt.subplots(*grid, figsize=(4 * cols, 3 * grid[0]), squeeze=False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        for kind in kinds:
            bands = [
                t_interval(list(by_seed(rows, kind, task, s, "digit_acc").values())) for s in steps
            ]
            ax.plot(steps, [b.mean for b in bands], label=kind, linewidth=1)
            ax.fill_between(steps, [b.low for b in bands], [b.high for b in bands], alpha=0.15)
        best = next(r["best_digit_acc"] for r in rows if r["task"] == task)
        ax.axhline(THRESHOLD * best, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("digit accuracy", fontsize=8)
    written.append(_save(fig, axes, out / "curves.png"))

    others = [k for k in kinds if k != BASELINE]
    fig, axes = plt.subplots(
        1,
        len(EFFECTS),
        figsize=(4 * len(EFFECTS), 0.3 * len(tasks) * len(others) + 1.5),
        squeeze=False,
    )
    for ax, (metric, label, _) in zip(axes.flat, EFFECTS, strict=True):
        table = effects(rows, metric)
        y = 0
        for task in tasks:
            for i, kind in enumerate(others):
                e = table[task, kind]
                err = [[e.mean - e.low], [e.high - e.mean]] if not math.isnan(e.low) else None
                ax.errorbar(
                    [e.mean],
                    [y],
                    xerr=err,
                    fmt="o",
                    markersize=3,
                    color=f"C{i}",
                    label=kind if task == tasks[0] else None,
                )
                y += 1
            y += 1
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.set_yticks([i * (len(others) + 1) + (len(others) - 1) / 2 for i in range(len(tasks))])
        ax.set_yticklabels(tasks, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{label}\nminus MLE (95% CI)", fontsize=8)
    written.append(_save(fig, axes, out / "effects.png"))

    fig, axes = plt.subplots(*grid, figsize=(4 * cols, 3 * grid[0]), squeeze=False)
    last = steps[-1]
    for ax, task in zip(axes.flat, tasks, strict=False):
        for i, kind in enumerate(kinds):
            e = t_interval(list(by_seed(rows, kind, task, last, "digit_entropy").values()))
            err = [[e.mean - e.low], [e.high - e.mean]] if not math.isnan(e.low) else None
            ax.errorbar([i], [e.mean], yerr=err, fmt="o", color=f"C{i}")
        truth = next(r["true_digit_entropy"] for r in rows if r["task"] == task)
        ax.axhline(truth, color="black", linestyle="--", linewidth=1, label="true entropy")
        ax.set_xticks(range(len(kinds)))
        ax.set_xticklabels(kinds, rotation=45, fontsize=7)
        ax.set_title(task, fontsize=9)
        ax.set_ylabel("digit entropy (nats)", fontsize=8)
    written.append(_save(fig, axes, out / "entropy.png"))
    return written


def pairing_table(rows: list[dict], kind: str = POWER_KIND) -> str:
    """Per task: how much pairing by seed narrows `kind` minus MLE in digit accuracy: the
    correlation over seeds of the two kinds' values, and the SD of the difference paired by
    seed and as if unpaired (sqrt of the sum of the two variances); then what it says."""
    if kind not in {r["kind"] for r in rows}:
        return ""
    last = max(r["step"] for r in rows)
    helps, hurts = [], []
    lines = [
        f"| task | seed correlation of MLE and {kind} | SD paired | SD unpaired | ratio |",
        "|---|---|---|---|---|",
    ]
    for task in _order(r["task"] for r in rows):
        mine = by_seed(rows, kind, task, last, "digit_acc")
        theirs = by_seed(rows, BASELINE, task, last, "digit_acc")
        seeds = sorted(mine.keys() & theirs.keys())
        x, y = [theirs[s] for s in seeds], [mine[s] for s in seeds]
        if len(seeds) < 3 or not statistics.stdev(x) or not statistics.stdev(y):
            lines.append(f"| {task} | – | – | – | – |")
            continue
        paired = statistics.stdev([b - a for a, b in zip(x, y, strict=True)])
        unpaired = math.sqrt(statistics.variance(x) + statistics.variance(y))
        ratio = f"{unpaired / paired:.1f}x" if paired else "–"
        r = statistics.correlation(x, y)
        if paired and unpaired / paired >= 2:
            helps.append(f"{task} ({ratio}, correlation {r:+.2f})")
        if r < 0:
            hurts.append(f"{task} ({r:+.2f})")
        lines.append(f"| {task} | {r:+.2f} | {paired:.4f} | {unpaired:.4f} | {ratio} |")
    said = (
        "Pairing narrows the SD twofold or more on "
        + (", ".join(helps) or "no task")
        + "; the correlation is negative (pairing widens the SD) on "
        + (", ".join(hurts) or "no task")
        + "."
    )
    return "\n".join(lines) + "\n\n" + said + "\n"


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
    """The page; date, machine and commit as recorded when the run ended (protocol.json),
    never the regenerating machine's."""
    effect_md, notes, tested = effect_tables(rows)
    last = max(r["step"] for r in rows)
    took = "" if math.isnan(minutes) else f"{minutes:.0f} minutes on "
    noted = "\n".join(f"* {n}" for n in notes) or "* none: no interval excludes 0"
    by_holm, by_bh, tests = corrected(rows)
    survive = (
        f"Corrected for the {tests} paired t tests behind these intervals (two-sided, from "
        f"{MIN_PAIRS} seeds): Holm at {FAMILY_WIDE:.0%} (family-wise) keeps "
        f"{len(by_holm)}, Benjamini–Hochberg at {FAMILY_WIDE:.0%} (false discoveries) "
        f"keeps {len(by_bh)}. Only these are findings; every other **✱** is a lead.\n\n"
        "Holm:\n\n" + ("\n".join(f"* {n}" for n in by_holm) or "* none") + "\n\n"
        "Benjamini–Hochberg:\n\n" + ("\n".join(f"* {n}" for n in by_bh) or "* none")
    )
    # many intervals at 95% each: some exclude 0 by chance alone, so say how many to expect
    chance = (
        f"{len(notes)} of {tested} intervals exclude 0; with no real difference anywhere, "
        # rounded first: 1 - 0.95 is not exactly 0.05 in binary
        f"about {round(tested * (1 - CONFIDENCE), 9):.0f} would by chance alone "
        f"({1 - CONFIDENCE:.0%} each). The intervals share the MLE runs and the metrics are "
        "correlated, so that count is no test; the correction below is."
    )
    return f"""# Numeric tasks: every loss kind against MLE

`{command}`, {date}, {took}{machine}, commit {commit}.

Protocol: {json.dumps(protocol)}. Metrics on each task's held-out answers at step {last}
(the last); mean ± standard deviation over seeds. Differences to MLE are paired by seed,
with a 95% Student t interval; **✱** marks an interval that excludes 0 (from
{MIN_PAIRS} seeds or more; fewer make no claim). Recompute
everything from raw_runs.jsonl: `python -m experiments.numeric_tasks.report
raw_runs.jsonl --out DIR`.

## Where an interval excludes 0

{chance}

{noted}

## What survives a correction for multiplicity

{survive}

## What {POWER_KIND} against MLE can show here

An interval that includes 0 is an absence of evidence at this power, not an equivalence:
per task, the half-width of the 95% interval of {POWER_KIND} minus MLE and the smallest true
difference a paired test at 5% (uncorrected) would find with {POWER:.0%} power, from the
observed spread of the paired differences. An effect below it cannot be seen here.

{power_table(rows)}
What pairing by seed buys ({POWER_KIND} minus MLE, digit accuracy at the last step):

{pairing_table(rows)}
## Final metrics

{final_table(rows)}
## Differences to MLE

{effect_md}
## Steps to {THRESHOLD} of the best digit accuracy

The first evaluated step whose digit accuracy reaches {THRESHOLD} of the best any model can
reach (1 for exact tasks; the noisy task's true top probabilities): mean over the seeds
that reach it (how many of them do).

{threshold_table(rows)}
![learning curves](curves.png)
![effects](effects.png)
![entropy against the truth](entropy.png)
"""


def write_outputs(rows: list[dict], out: Path, recorded: dict) -> Path:
    """The plots and report.md of `rows` into `out`; recorded: {protocol, command, minutes,
    date, machine, commit} (protocol.json)."""
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
    runs: list[dict], out: Path, *, protocol: dict, command: str, minutes: float
) -> Path:
    """raw_runs.jsonl and protocol.json (what the report is made from, with the date,
    machine and commit of the run, recorded now, as it ends), then the report."""
    from ..machine import provenance

    rows = raw_rows(runs)
    recorded = {"protocol": protocol, "command": command, "minutes": minutes, **provenance()}
    write_text_atomic(out / "raw_runs.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_text_atomic(out / "protocol.json", json.dumps(recorded, indent=1) + "\n")
    return write_outputs(rows, out, recorded)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", nargs="?", type=Path, help="raw_runs.jsonl (protocol.json beside)")
    p.add_argument(
        "--evaluated",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="instead: del-eval --tasks results of runs named KIND-SEED",
    )
    p.add_argument("--command", default="", help="what made the runs (with --evaluated)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if (a.raw is None) == (a.evaluated is None):
        p.error("give raw_runs.jsonl or --evaluated DIR ...")
    try:
        if a.evaluated:
            runs = [run_of_evaluation(d) for d in a.evaluated]
            write_report(runs, a.out, protocol={}, command=a.command, minutes=math.nan)
        else:
            recorded = json.loads((a.raw.parent / "protocol.json").read_text())
            write_outputs(read_raw(a.raw), a.out, recorded)
    except (UserError, OSError, json.JSONDecodeError, KeyError) as err:
        print(f"numeric-task report: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
