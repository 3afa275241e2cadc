"""Evaluation results as files: results.json (everything), results.md (a table), and for a
comparison of runs, PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..outputs import abandon_output, begin_output, commit_output

SUMMARY = [  # (label, path in results.json, format)
    # teacher-forced cross entropy: not a training objective's CE + alpha * numeric term
    ("loss (CE)", ("numeric", "loss"), ".4f"),
    ("perplexity", ("numeric", "perplexity"), ".2f"),
    ("digit acc", ("numeric", "digit_acc"), ".4f"),
    ("digit acc among digits", ("numeric", "digit_cond_acc"), ".4f"),
    ("number exact", ("numeric", "number_exact_match"), ".4f"),
    ("number abs err", ("numeric", "number_abs_error"), ".3g"),
    ("number rel err", ("numeric", "number_rel_error"), ".3g"),
    ("digit entropy", ("numeric", "digit_entropy"), ".4f"),
    # is DEL learned from or escaped (docs/losses.md): the digit logits' level, which
    # softmax ignores, and the digit term's share of the loss ('numeric_term' says whose)
    ("digit logit (mean)", ("numeric", "digit_logit"), ".3f"),
    ("digit logsumexp", ("numeric", "digit_logsumexp"), ".3f"),
    ("numeric term share", ("numeric", "numeric_share"), ".4f"),
    ("digit ECE", ("numeric", "digit_calibration_error"), ".4f"),
    ("gen accuracy", ("generation", "accuracy"), ".4f"),
    ("gen abs err", ("generation", "mean_abs_error"), ".3g"),
]


def _get(results: dict, path: tuple[str, ...]) -> float | None:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, int | float) else None


def markdown_table(results: dict) -> str:
    rows = ["| metric | value |", "|---|---|"]
    seq_len = _get(results, ("numeric", "seq_len"))
    if seq_len is not None:  # the windows the teacher-forced metrics were measured on
        rows.append(f"| windows (tokens) | {seq_len} |")
    for label, path, fmt in SUMMARY:
        value = _get(results, path)
        if value is not None:
            rows.append(f"| {label} | {value:{fmt}} |")
    term = results.get("numeric", {}).get("numeric_term")
    if isinstance(term, str) and _get(results, ("numeric", "numeric_share")) is not None:
        rows.append(f"| numeric term of | {term} |")
    places = results.get("numeric", {}).get("digit_acc_by_place", {})
    if places:
        rows.append(
            "| digit acc by place | " + ", ".join(f"{k} {v:.3f}" for k, v in places.items()) + " |"
        )
    for task, m in results.get("tasks", {}).items():  # the numeric task suite (--tasks)
        rows.append(
            f"| task {task} | digit acc {m['digit_acc']:.3f}, exact "
            f"{m['exact_teacher_forced']:.3f} (teacher-forced) / {m['exact_greedy']:.3f} "
            "(greedy), digit entropy "
            f"{m['digit_entropy']:.3f} (true {m['true_digit_entropy']:.3f}), ECE "
            f"{m['digit_ece']:.3f} |"
        )
    return "\n".join(rows) + "\n"


RESULT_FILES = ("results.json", "results.md")


def write_results(out: Path, results: dict) -> None:
    """results.json and results.md in `out`, put in place together when both are written;
    an earlier evaluation's are set aside (del_megatron/outputs.py), other files kept."""

    def is_ours(path: Path) -> bool:
        return path.name in RESULT_FILES

    staging = begin_output(out, is_ours, force=True)  # beside the user's files, e.g. metrics
    try:
        (staging / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        (staging / "results.md").write_text(
            f"# {results.get('model', 'evaluation')}\n\n" + markdown_table(results)
        )
        commit_output(staging, out, is_ours)
    except BaseException:
        abandon_output(staging)
        raise


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value); NaNs left out."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    if not kept:
        return float("nan"), float("nan")
    return statistics.fmean(kept), statistics.stdev(kept) if len(kept) > 1 else 0.0


def window_note(groups: dict[str, list[dict]]) -> str:
    """A note when the runs' teacher-forced metrics come from windows of different lengths
    (not comparable as they stand: longer windows see more context); '' when they agree."""
    lengths = {
        name: sorted({_get(r, ("numeric", "seq_len")) for r in runs} - {None})
        for name, runs in groups.items()
    }
    if len({n for ns in lengths.values() for n in ns}) <= 1:
        return ""
    each = ", ".join(f"{name} {'/'.join(map(str, ns))}" for name, ns in lengths.items() if ns)
    return (
        f"note: the teacher-forced metrics come from windows of different lengths ({each} "
        "tokens); evaluate with one --seq-len to compare them"
    )


def comparison_table(groups: dict[str, list[dict]]) -> str:
    """One row per group (a loss kind), mean ± spread over its runs (seeds)."""
    shown = [
        (label, path, fmt)
        for label, path, fmt in SUMMARY
        if any(_get(r, path) is not None for rs in groups.values() for r in rs)
    ]
    header = "| run | n | " + " | ".join(label for label, _, _ in shown) + " |"
    rows = [header, "|---|---|" + "---|" * len(shown)]
    for name, runs in groups.items():
        cells = []
        for _, path, fmt in shown:
            mean, spread = mean_and_spread([_get(r, path) for r in runs])
            cells.append(f"{mean:{fmt}} ± {spread:{fmt}}" if not math.isnan(mean) else "—")
        rows.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def plot_comparison(
    groups: dict[str, list[dict]], curves: dict[str, list[list[tuple[int, float]]]], out: Path
) -> list[Path]:
    """digit_entropy.png (histograms of H(p̂) per group), place_accuracy.png (accuracy by
    place), loss_curves.png (training cross entropy from metrics.jsonl, mean over runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in groups.items():
        hists = [
            r["numeric"]["digit_entropy_histogram"]
            for r in runs
            if "digit_entropy_histogram" in r.get("numeric", {})
        ]
        if not hists:
            continue
        edges = hists[0]["edges"]
        counts = [sum(h["counts"][i] for h in hists) for i in range(len(edges) - 1)]
        total = sum(counts) or 1
        centers = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        ax.plot(centers, [c / total for c in counts], marker=".", label=name)
    ax.axvline(math.log(10), color="grey", linestyle=":", label="ln 10 (uniform)")
    ax.set_xlabel("digit entropy H(p̂) at digit targets (nats)")
    ax.set_ylabel("share of digit positions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "digit_entropy.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in groups.items():
        places = {}
        for r in runs:
            for key, value in r.get("numeric", {}).get("digit_acc_by_place", {}).items():
                places.setdefault(key, []).append(value)
        order = sorted(places, key=_place_order)
        ax.plot(order, [statistics.fmean(places[k]) for k in order], marker="o", label=name)
    ax.set_xlabel("place (int_0 = units, dec_1 = tenths)")
    ax.set_ylabel("digit accuracy (greedy among digits)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "place_accuracy.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    if not any(points for runs in curves.values() for points in runs):
        return written  # no run has metrics.jsonl: no curves, rather than an empty plot
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in curves.items():
        if not runs:
            continue
        steps = sorted({s for run in runs for s, _ in run})
        by_step = [dict(run) for run in runs]
        mean = [statistics.fmean(r[s] for r in by_step if s in r) for s in steps]
        ax.plot(steps, mean, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training cross entropy (comparable across kinds)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "loss_curves.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def _place_order(key: str) -> tuple[int, int]:
    kind, _, number = key.partition("_")
    return (0, -int(number)) if kind == "int" else (1, int(number))


def read_curve(metrics_jsonl: Path) -> list[tuple[int, float]]:
    """(step, training CE) from a run's metrics.jsonl; a last line cut by a kill is left out,
    any other line that is not a JSON object is refused with its number."""
    try:
        text = metrics_jsonl.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{metrics_jsonl}: cannot read ({err})") from None
    lines = text.split("\n")[:-1]  # what follows the last newline was cut short
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{metrics_jsonl} line {number}: not JSON ({err})") from None
        if isinstance(row, dict) and isinstance(row.get("step"), int | float):
            rows.append(row)
    key = "ce" if rows and "ce" in rows[0] else "loss"  # CE: the one term every kind shares
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
