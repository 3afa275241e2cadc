"""Comparing evaluated runs (`del-eval compare`): read their results, group them, check that
teacher-forced metrics agree within a tolerance (e.g. a checkpoint and its export), and
write the comparison table and plots."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError


@dataclass(frozen=True)
class Comparison:
    table: str  # markdown, as written to comparison.md
    plots: list[Path]
    curves: int  # runs with a metrics.jsonl (loss curves plotted)
    agreement: str | None  # the line saying the metrics agree, when asked


def read_results(directory: Path) -> dict:
    """The results.json of one del-eval run."""
    path = directory / "results.json"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not readable results ({err})") from None
    if not isinstance(result, dict):
        raise UserError(f"{path}: not del-eval results (a JSON object)")
    return result


def group_name(directory: Path, group_by: str) -> str:
    """run: the directory's name; parent-name: runs named KIND-SEED group by KIND."""
    return directory.name.rsplit("-", 1)[0] if group_by == "parent-name" else directory.name


def check_agreement(results: list[dict], tolerance: float) -> str:
    """Every scalar teacher-forced metric equal across `results` within `tolerance`
    (relative to max(1, |value|)); the line saying so, or a UserError naming the first that
    differs."""
    numeric = [r["numeric"] for r in results if isinstance(r.get("numeric"), dict)]
    if len(numeric) != len(results) or len(numeric) < 2:
        raise UserError("--agree-within needs two or more results with teacher-forced metrics")
    for key, value in numeric[0].items():
        if not isinstance(value, int | float):
            continue
        values = [n.get(key) for n in numeric]
        if not all(isinstance(v, int | float) for v in values):
            raise UserError(f"{key} is missing from some of the results: {values}")
        if max(values) - min(values) > tolerance * max(1.0, abs(value)):
            raise UserError(f"{key} differs beyond {tolerance:g}: {values}")
    return f"teacher-forced metrics agree within {tolerance:g}"


def compare_runs(
    directories: list[Path],
    out: Path,
    *,
    group_by: str = "run",
    agree_within: float | None = None,
) -> Comparison:
    """Everything read and checked first (nothing written by a comparison that fails), then
    out/comparison.md and the plots."""
    from ..outputs import write_text_atomic
    from .report import comparison_table, plot_comparison, read_curve, window_note

    groups: dict[str, list[dict]] = {}
    curves: dict[str, list] = {}
    for directory in directories:
        name = group_name(directory, group_by)
        groups.setdefault(name, []).append(read_results(directory))
        metrics = directory / "metrics.jsonl"
        if metrics.is_file():
            curves.setdefault(name, []).append(read_curve(metrics))
    agreement = None
    if agree_within is not None:
        agreement = check_agreement([r for rs in groups.values() for r in rs], agree_within)
    table = comparison_table(groups)
    note = window_note(groups)
    if note:
        table += f"\n{note}\n"
    write_text_atomic(out / "comparison.md", table)
    plots = plot_comparison(groups, curves, out)
    return Comparison(table, list(plots), sum(len(c) for c in curves.values()), agreement)
