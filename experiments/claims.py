"""The numbers the results pages' hand-written sentences quote (docs/results.md,
docs/losses.md), recomputed from the committed raw rows (issue 53): one line per claim,
so that a sentence can be checked against its number and a changed row shows.

    python -m experiments.claims
"""

from __future__ import annotations

import itertools
import math
import statistics

from . import REPOSITORY
from .continuations.report import trends
from .effects import paired_differences, t_interval
from .numeric_tasks.report import read_raw

RESULTS = REPOSITORY / "docs" / "results"


def _by_seed(rows: list[dict], kind: str, task: str, metric: str) -> dict[int, float]:
    return {
        r["seed"]: float(r[metric])
        for r in rows
        if r["kind"] == kind and r["task"] == task and metric in r
    }


def _ci(values: list[float], spec: str = "+.3f") -> str:
    i = t_interval(values)
    return f"{i.mean:{spec}} [{i.low:{spec}}, {i.high:{spec}}]"


def continuation_claims(rows: list[dict]) -> list[str]:
    out = []
    last_step = max(r["step"] for r in rows if r["task"] != "_train" and r["kind"] != "base")
    last = [r for r in rows if r["task"] != "_train" and r["step"] == last_step]
    last = [r for r in last if r["kind"] != "base"]
    tasks = sorted({r["task"] for r in last})
    # the accuracy slopes against their detectable slope
    for (task, metric, *_), t in trends(rows, "del"):
        if metric == "digit_acc":
            side = "above" if abs(t.slope) > t.mde else "at or below"
            out.append(
                f"DEL slope, {task} digit accuracy: {t.slope:+.4f} per decade, detectable "
                f"±{t.mde:.4f}: {side}"
            )
    # robustness of the seven primary trends: without alpha = 3, and per base (the base the
    # unit: one slope per base, a one-sample t test over bases), each Holm over the seven
    from .continuations.report import PRIMARY, trend
    from .effects import holm, paired_p

    evaluated = [r for r in last if r["family"] == "del"]
    without, per_base = [], []
    for task, metric, *_ in PRIMARY:
        points = [
            (r["seed"], math.log10(r["alpha"]), float(r[metric]))
            for r in evaluated
            if r["task"] == task and metric in r
        ]
        without.append(trend([q for q in points if q[1] < math.log10(3)], len(PRIMARY)).p)
        slopes = []
        for seed in sorted({q[0] for q in points}):
            xs = [q[1] for q in points if q[0] == seed]
            ys = [q[2] for q in points if q[0] == seed]
            slopes.append(statistics.covariance(xs, ys) / statistics.variance(xs))
        per_base.append(paired_p(slopes))
    for name, ps in (("without alpha = 3", without), ("per base (df 3)", per_base)):
        kept = sum(p < 0.05 for p in holm(ps))
        out.append(f"primary trends surviving Holm {name}: {kept} of {len(PRIMARY)}")
    # the placebo's intervals excluding 0, over the page's 6 metrics x 8 tasks
    from .continuations.report import EXPLORATORY_METRICS

    outside, tested = [], 0
    for metric, _, _ in EXPLORATORY_METRICS:
        for task in tasks:
            d = paired_differences(
                _by_seed(last, "placebo", task, metric), _by_seed(last, "mle", task, metric)
            )
            tested += 1
            if t_interval(d).excludes_zero:
                outside.append(f"{task} {metric} {statistics.fmean(d):+.3g}")
    out.append(f"placebo intervals excluding 0: {len(outside)} of {tested}: {'; '.join(outside)}")
    # DIST2 and NTL entropy-gap signs (numeric-task comparison below)
    signs = {}
    for kind in ("dist2-0.1", "ntl_was-0.3"):
        signs[kind] = {
            task: statistics.fmean(
                paired_differences(
                    _by_seed(last, kind, task, "entropy_gap"),
                    _by_seed(last, "mle", task, "entropy_gap"),
                )
            )
            for task in tasks
        }
    # DEL's number MAE against alpha, per task (monotone?)
    alphas = (0.1, 0.3, 1, 3)
    monotone = []
    for task in tasks:
        means = [
            statistics.fmean(_by_seed(last, f"del-{a:g}", task, "number_mae").values())
            for a in alphas
        ]
        if all(b > a for a, b in itertools.pairwise(means)):
            monotone.append(task)
    out.append(
        f"DEL number MAE rising with alpha at every step 0.1 < 0.3 < 1 < 3: "
        f"{len(monotone)} of {len(tasks)} tasks ({', '.join(monotone)})"
    )
    # the shift-invariant DEL against DEL, entropy gap averaged over the four alphas
    for task in ("add", "subtract", "multiply"):
        per_base = [
            statistics.fmean(
                _by_seed(last, f"del_si-{a:g}", task, "entropy_gap")[seed]
                - _by_seed(last, f"del-{a:g}", task, "entropy_gap")[seed]
                for a in alphas
            )
            for seed in sorted(_by_seed(last, "mle", task, "entropy_gap"))
        ]
        out.append(f"del_si minus del, {task} entropy gap, mean over alpha: {_ci(per_base)}")
    # CE and digit entropy of the escaped term, paired with MLE at the last training step
    train = [r for r in rows if r["task"] == "_train" and r["kind"] != "base"]
    step = max(r["step"] for r in train if r["kind"] == "mle")
    at = [r for r in train if r["step"] == step]
    for key in ("ce", "digit_entropy"):
        for a in alphas:
            d = paired_differences(
                _by_seed(at, f"del-{a:g}", "_train", key), _by_seed(at, "mle", "_train", key)
            )
            out.append(f"del-{a:g} minus mle, training {key} at step {step}: {_ci(d)}")
    for a in alphas:
        share = [float(r["numeric_grad_share"]) for r in at if r["kind"] == f"del-{a:g}"]
        cos = [float(r["numeric_grad_cos"]) for r in at if r["kind"] == f"del-{a:g}"]
        out.append(
            f"del-{a:g} at step {step}: the term's share of the logit gradient "
            f"{statistics.fmean(share):.3f}, its cosine with CE's {statistics.fmean(cos):+.3f} "
            f"(mean over {len(share)} bases)"
        )
    return out, signs


def numeric_task_claims(rows: list[dict], continuation_signs: dict) -> list[str]:
    out = []
    last = max(r["step"] for r in rows)
    rows = [r for r in rows if r["step"] == last]
    tasks = sorted({r["task"] for r in rows})
    # pairing by seed: the seed correlation of MLE and DEL digit accuracy per task
    for task in tasks:
        mle, de = _by_seed(rows, "mle", task, "digit_acc"), _by_seed(rows, "del", task, "digit_acc")
        seeds = sorted(mle.keys() & de.keys())
        x, y = [mle[s] for s in seeds], [de[s] for s in seeds]
        r = statistics.correlation(x, y) if statistics.stdev(x) and statistics.stdev(y) else 0
        paired = statistics.stdev([b - a for a, b in zip(x, y, strict=True)])
        unpaired = math.sqrt(statistics.variance(x) + statistics.variance(y))
        out.append(
            f"numeric tasks, {task}: seed correlation of MLE and DEL digit accuracy {r:+.2f}; "
            f"SD of the difference paired {paired:.4f}, unpaired {unpaired:.4f} "
            f"({unpaired / paired:.1f}x)"
        )
    # the entropy-gap signs of DIST2 and NTL-WAS here and in the continuations
    for kind, name in (("dist2", "dist2-0.1"), ("ntl_was", "ntl_was-0.3")):
        same = []
        for task in tasks:
            d = statistics.fmean(
                paired_differences(
                    _by_seed(rows, kind, task, "entropy_gap"),
                    _by_seed(rows, "mle", task, "entropy_gap"),
                )
            )
            if math.copysign(1, d) == math.copysign(1, continuation_signs[name][task]):
                same.append(task)
        out.append(
            f"{kind}: entropy-gap difference to MLE of the same sign in both runs on "
            f"{len(same)} of {len(tasks)} tasks ({', '.join(same)})"
        )
    return out


def ruled_out(rows: list[dict], baseline: str, margin: float = 0.025) -> list[str]:
    """Per kind against `baseline` at the last evaluated step, digit accuracy: on how many
    tasks the 95% interval's upper end is below +margin (a gain of the margin ruled out)
    and its lower end above -margin (a loss of the margin ruled out)."""
    evaluated = [r for r in rows if r["task"] != "_train" and r["kind"] != "base"]
    step = max(r["step"] for r in evaluated)
    last = [r for r in evaluated if r["step"] == step]
    tasks = sorted({r["task"] for r in last})
    out = []
    for kind in dict.fromkeys(r["kind"] for r in last):
        if kind == baseline:
            continue
        intervals = [
            t_interval(
                paired_differences(
                    _by_seed(last, kind, t, "digit_acc"), _by_seed(last, baseline, t, "digit_acc")
                )
            )
            for t in tasks
        ]
        gain = sum(i.high < margin for i in intervals)
        loss = sum(i.low > -margin for i in intervals)
        highest = max(i.high for i in intervals)
        out.append(
            f"{kind} minus {baseline}, digit accuracy at step {step}: a +{margin} gain ruled out "
            f"on {gain} of {len(tasks)} tasks, a -{margin} loss on {loss}; highest upper end "
            f"{highest:+.3f}"
        )
    return out


def comparison_claims() -> list[str]:
    """The older loss comparison (docs/results.md's table: mean ± SD over 3 seeds): each
    kind's shift against MLE in units of the pooled SD, and Welch's t test."""
    from scipy.stats import ttest_ind_from_stats

    table = (RESULTS / "comparison.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| run |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    values = {}
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(columns) and cells[0] in ("mle", "dist2", "del", "ntl_was", "emo"):
            values[cells[0]] = dict(zip(columns, cells, strict=True))
    out = []
    for kind, column in (
        ("ntl_was", "digit entropy"),
        ("emo", "digit entropy"),
        ("dist2", "digit entropy"),
        ("del", "digit entropy"),
        ("del", "loss"),
    ):
        (m1, s1), (m0, s0) = (
            tuple(float(v) for v in values[k][column].split(" ± ")) for k in (kind, "mle")
        )
        n = int(values[kind]["n"])
        pooled = math.sqrt((s1**2 + s0**2) / 2)
        p = ttest_ind_from_stats(m1, s1, n, m0, s0, n, equal_var=False).pvalue
        out.append(
            f"comparison, {kind} minus mle, {column}: {m1 - m0:+.4f} = {(m1 - m0) / pooled:+.1f} "
            f"pooled SD, Welch p {p:.3f} (n {n} a kind)"
        )
    return out


def main() -> int:
    continuation = read_raw(RESULTS / "continuations" / "raw_runs.jsonl")
    numeric = read_raw(RESULTS / "numeric-tasks" / "raw_runs.jsonl")
    lines, signs = continuation_claims(continuation)
    lines += numeric_task_claims(numeric, signs)
    lines += comparison_claims()
    lines += ruled_out(numeric, "mle") + ruled_out(continuation, "mle")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
