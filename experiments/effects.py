"""Effect sizes between loss kinds: each kind's difference to a baseline paired by seed, with
a t confidence interval, and steps-to-threshold of learning curves. Pure functions on
numbers: the experiments' reports (`numeric_tasks.report`, `continuations.report`) recompute
every interval from the raw per-run metrics with them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Fewer pairs give no claim: with 2 seeds a discrete metric (digit accuracy on a few hundred
# digits) often moves by the same amount at both, a zero-width interval that says nothing.
MIN_PAIRS = 3
CONFIDENCE = 0.95  # of every interval the report gives


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int  # pairs

    @property
    def testable(self) -> bool:
        """From MIN_PAIRS pairs or more: an interval that may be read as excluding 0."""
        return self.n >= MIN_PAIRS

    @property
    def excludes_zero(self) -> bool:
        """The interval excludes 0, from MIN_PAIRS pairs or more."""
        return self.testable and (self.low > 0 or self.high < 0)


def t_interval(values: list[float], confidence: float = CONFIDENCE) -> Interval:
    """The mean of `values` and its two-sided Student t interval (n - 1 degrees of
    freedom); NaN bounds for fewer than two values. NaN values are left out."""
    from scipy.stats import t

    kept = [v for v in values if not math.isnan(v)]
    n = len(kept)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = statistics.fmean(kept)
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    half = t.ppf(0.5 + confidence / 2, n - 1) * statistics.stdev(kept) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def paired_differences(values: dict[int, float], baseline: dict[int, float]) -> list[float]:
    """value - baseline for each seed both have, in seed order (the pairing: the same seed
    draws the same initial weights' stream and data order in both runs)."""
    return [values[s] - baseline[s] for s in sorted(values.keys() & baseline.keys())]


def paired_effect(
    values: dict[int, float], baseline: dict[int, float], confidence: float = CONFIDENCE
) -> Interval:
    """The mean difference to the baseline over seeds, with its paired t interval."""
    return t_interval(paired_differences(values, baseline), confidence)


def steps_to_threshold(
    curve: list[tuple[int, float]], threshold: float, *, higher_is_better: bool = True
) -> int | None:
    """The first evaluated step whose value reaches `threshold` (None: the curve never does)."""
    for step, value in sorted(curve):
        if value >= threshold if higher_is_better else value <= threshold:
            return step
    return None


def paired_p(differences: list[float]) -> float:
    """Two-sided p of the one-sample Student t test of mean 0 (n - 1 degrees of freedom);
    NaN below two differences. Differences all equal: 0 if they are not 0, else 1."""
    from scipy.stats import t

    kept = [d for d in differences if not math.isnan(d)]
    if len(kept) < 2:
        return math.nan
    mean, spread = statistics.fmean(kept), statistics.stdev(kept)
    if spread == 0:
        return 0.0 if mean != 0 else 1.0
    return float(2 * t.sf(abs(mean) / (spread / math.sqrt(len(kept))), len(kept) - 1))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error); NaN stays NaN and is not
    counted as a test."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    m, adjusted, running = len(tested), [math.nan] * len(p_values), 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def benjamini_hochberg(p_values: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (false discovery rate); NaN stays NaN and is not
    counted as a test."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    m, adjusted, running = len(tested), [math.nan] * len(p_values), 1.0
    for rank in range(m - 1, -1, -1):
        p, i = tested[rank]
        running = min(running, p * m / (rank + 1))
        adjusted[i] = running
    return adjusted


def equivalence_p(differences: list[float], margin: float) -> float:
    """Two one-sided tests (TOST) of |mean| < margin on paired differences: the larger of
    the one-sided Student t p-values of mean <= -margin and of mean >= +margin (n - 1
    degrees of freedom). Equivalence at level a is p < a, which is the same as the
    (1 - 2a) t interval lying inside (-margin, +margin). NaN below two differences."""
    from scipy.stats import t

    kept = [d for d in differences if not math.isnan(d)]
    if len(kept) < 2:
        return math.nan
    mean, spread, n = statistics.fmean(kept), statistics.stdev(kept), len(kept)
    if spread == 0:
        return 0.0 if abs(mean) < margin else 1.0
    se = spread / math.sqrt(n)
    above = t.sf((mean + margin) / se, n - 1)  # H0: mean <= -margin
    below = t.cdf((mean - margin) / se, n - 1)  # H0: mean >= +margin
    return float(max(above, below))


def detectable_difference(sd: float, n: int, alpha: float, power: float) -> float:
    """The smallest true mean difference a two-sided paired t test at `alpha` finds with
    `power`, for n pairs whose differences spread with standard deviation `sd`: exact, from
    the noncentral t distribution (n - 1 degrees of freedom)."""
    import numpy as np
    from scipy.optimize import brentq
    from scipy.stats import nct, t

    if n < 2 or math.isnan(sd) or sd <= 0:
        return math.nan
    df, critical = n - 1, t.ppf(1 - alpha / 2, n - 1)

    def short(shift: float) -> float:  # power at noncentrality `shift`, less the wanted
        wrong_side = nct.cdf(-critical, df, shift)  # NaN where it underflows far from 0
        return nct.sf(critical, df, shift) + float(np.nan_to_num(wrong_side)) - power

    # the normal approximation's noncentrality, doubled, brackets the root from above
    guess = t.ppf(1 - alpha / 2, df) + t.ppf(power, df)
    return float(brentq(short, 0.0, 2 * guess) * sd / math.sqrt(n))


def provable_margin(sd: float, n: int, alpha: float, power: float) -> float:
    """The smallest equivalence margin that two one-sided tests, each at `alpha`, establish
    with `power` when the true difference is 0, for n pairs with standard deviation `sd`:
    (t_{1-alpha} + t_{(1+power)/2}) sd / sqrt(n) (both one-sided tests must pass; the usual
    approximation, which treats the estimated SD as known)."""
    from scipy.stats import t

    if n < 2 or math.isnan(sd):
        return math.nan
    return float((t.ppf(1 - alpha, n - 1) + t.ppf((1 + power) / 2, n - 1)) * sd / math.sqrt(n))


def sign_flip_p(differences: list[float]) -> float:
    """Two-sided p of the exact sign-flip (paired permutation) test of mean 0: the share of
    the 2^n sign patterns whose |mean| reaches the observed one. No normality assumed; NaN
    below two differences or above 20 (2^20 patterns)."""
    import itertools

    kept = [d for d in differences if not math.isnan(d)]
    if not 2 <= len(kept) <= 20:
        return math.nan
    observed = abs(sum(kept)) - 1e-12 * max(1.0, sum(abs(d) for d in kept))
    hits = sum(
        abs(sum(s * d for s, d in zip(signs, kept, strict=True))) >= observed
        for signs in itertools.product((1, -1), repeat=len(kept))
    )
    return hits / 2 ** len(kept)
