"""Effect sizes (experiments/effects.py): the paired t interval against values computed by
hand, pairing by seed, and steps-to-threshold."""

from __future__ import annotations

import math

import pytest

from experiments.effects import (
    paired_differences,
    paired_effect,
    steps_to_threshold,
    t_interval,
)


def test_t_interval_by_hand():
    # mean 3, sample sd sqrt(2.5), t(0.975, 4) = 2.7764451: half-width 1.9632432
    interval = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert interval.mean == pytest.approx(3.0)
    assert interval.low == pytest.approx(3 - 2.7764451 * math.sqrt(2.5) / math.sqrt(5))
    assert interval.high == pytest.approx(3 + 1.9632432, abs=1e-6)
    assert interval.n == 5 and interval.excludes_zero
    # two values: t(0.975, 1) = 12.7062047
    two = t_interval([0.1, 0.3])
    assert two.high - two.mean == pytest.approx(12.7062047 * math.sqrt(0.02) / math.sqrt(2))
    assert not two.excludes_zero  # [-1.07, 1.47]
    # t(0.75, 2) = 0.8164966: [0.2 - 0.0471, 0.2 + 0.0471] excludes 0 at 50%
    assert t_interval([0.1, 0.2, 0.3], confidence=0.5).excludes_zero
    # two equal differences: a zero-width interval, and no claim from two seeds
    same = t_interval([-0.04, -0.04])
    assert same.low == same.high == pytest.approx(-0.04) and not same.excludes_zero


def test_too_few_values_have_no_interval():
    one = t_interval([2.0])
    assert one.mean == 2.0 and math.isnan(one.low) and not one.excludes_zero
    assert t_interval([]).n == 0
    assert t_interval([1.0, math.nan, 3.0]).n == 2  # a NaN metric is left out


def test_pairing_is_by_seed():
    kind = {3: 0.9, 1: 0.5, 2: 0.7, 7: 0.1}  # seed 7 has no baseline run
    baseline = {1: 0.4, 2: 0.5, 3: 0.6, 4: 0.0}
    assert paired_differences(kind, baseline) == pytest.approx([0.1, 0.2, 0.3])
    effect = paired_effect(kind, baseline)
    assert effect.n == 3 and effect.mean == pytest.approx(0.2)
    # unpaired, the spread of the baselines would swamp a constant difference: paired, none
    constant = paired_effect({1: 1.1, 2: 5.1, 3: 9.1}, {1: 1.0, 2: 5.0, 3: 9.0})
    assert constant.low == pytest.approx(0.1) and constant.high == pytest.approx(0.1)


def test_steps_to_threshold():
    curve = [(300, 0.85), (100, 0.4), (200, 0.81), (400, 0.7)]
    assert steps_to_threshold(curve, 0.8) == 200
    assert steps_to_threshold(curve, 0.9) is None
    assert steps_to_threshold([(100, 0.3), (200, 0.1)], 0.2, higher_is_better=False) == 200


def test_paired_p_holm_and_benjamini_hochberg_by_hand():
    from experiments.effects import benjamini_hochberg, holm, paired_p

    # mean 3, sd sqrt(2.5), n 5: t = 3 / (1.5811388 / 2.2360680) = 4.2426407, df 4:
    # two-sided p = 0.0132356 (scipy.stats.t.sf(4.2426407, 4) * 2)
    assert paired_p([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(0.0132356, abs=1e-6)
    assert math.isnan(paired_p([0.5]))
    assert paired_p([0.1, 0.1, 0.1]) == 0.0 and paired_p([0.0, 0.0]) == 1.0
    p = [0.01, 0.04, 0.03, math.nan, 0.005]
    # Holm over the 4 tested: sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1, running max
    assert holm(p)[4] == pytest.approx(0.02) and holm(p)[0] == pytest.approx(0.03)
    assert holm(p)[2] == pytest.approx(0.06) and holm(p)[1] == pytest.approx(0.06)
    assert math.isnan(holm(p)[3])
    # BH: p * m / rank, running min from the largest: 0.04, 0.04, 0.02, 0.02
    bh = benjamini_hochberg(p)
    assert bh[1] == pytest.approx(0.04) and bh[2] == pytest.approx(0.04)
    assert bh[0] == pytest.approx(0.02) and bh[4] == pytest.approx(0.02)
