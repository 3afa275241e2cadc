"""The confirmatory experiment (experiments/confirmatory/): its pre-registered analysis on
made-up rows built to be equivalent, superior, inferior or inconclusive (the decisions must
flip with them), the tests it rests on against independent computations, the planning
numbers against the earlier run's committed rows, the page regenerated from its raw rows
with the run's own provenance, and the runs the protocol makes. The whole pipeline on real
training runs is `launch/experiments/confirmatory.sh --ci`'s."""

from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np
import pytest

from experiments.confirmatory import prior
from experiments.confirmatory import report as cr
from experiments.confirmatory import run as ex
from experiments.continuations import run as cont
from experiments.continuations.report import raw_rows
from experiments.effects import (
    detectable_difference,
    equivalence_p,
    provable_margin,
    sign_flip_p,
)
from experiments.numeric_tasks.report import read_raw

from ..distributed.launcher import ROOT

TASKS = {
    "add": "hard",
    "add_carries": "easy",
    "convert": "easy",
    "copy": "easy",
    "multiply": "hard",
    "noisy": "easy",
    "reformat": "hard",
    "subtract": "hard",
}
ARMS = ("mle", "del-0.1", "del_si-0.1")


def fake_run(kind: str, seed: int, effect: float, sd: float, steps: int = 300) -> dict:
    """Made-up metrics of one continuation: a base level per seed and task shared by every
    arm; DEL 0.1 moved by `effect` on the room tasks (and by -0.5 on the noisy scale, which
    the endpoint must leave out), plus noise of `sd` on each task."""
    noise = random.Random(f"{kind}-{seed}-{steps}")
    tasks = {}
    for task, level in TASKS.items():
        base = random.Random(f"{seed}-{task}").uniform(0.2, 0.7)
        moved = 0.0
        if kind.startswith("del-0.1"):
            moved = effect if task in cr.ROOM_TASKS else -0.5
        tasks[task] = {
            "level": level,
            "digit_acc": base + moved + noise.gauss(0, sd),
            "exact_teacher_forced": base / 2 + moved + noise.gauss(0, sd),
            "exact_greedy": base / 2 + noise.gauss(0, sd),
            "greedy_problems": 200,
            "best_digit_acc": 0.7 if task == "noisy" else 1.0,
            "entropy_gap": 0.3,
            "number_mae": 3.0,
        }
    train = [{"step": s, "digit_logsumexp": 9.0, "ce": 0.8} for s in (1, 25)]
    return {
        "kind": kind,
        "loss_kind": "mle" if kind.startswith("mle") else "del",
        "family": "",
        "alpha": math.nan,
        "seed": seed,
        "curve": [{"step": steps, "tasks": tasks}],
        "train_curve": train,
    }


def runs(effect: float, sd: float = 0.004, bases: int = 12) -> list[dict]:
    seeds = range(101, 101 + bases)
    out = [fake_run(arm, s, effect, sd) for s in seeds for arm in ARMS]
    out += [fake_run(f"{arm}@1000", 101, effect, sd, steps=1000) for arm in ARMS]
    return out


def decisions(effect: float, **kwargs) -> tuple[list[str], str]:
    found = cr.family(raw_rows(runs(effect, **kwargs)), cr.PRIMARY_ARM)
    return [v for *_, v in found], cr.answer(found)


def test_the_decisions_flip_with_rows_built_equivalent_superior_inferior_or_unclear():
    verdicts, said = decisions(0.0)
    assert verdicts == ["equivalent within ±0.025"] * 2
    assert said == "DEL at α = 0.1 equals MLE within ±0.025 on every primary endpoint"
    verdicts, said = decisions(+0.05)
    assert verdicts == ["superior"] * 2
    assert said == "DEL at α = 0.1 beats MLE on digit accuracy and exact match, teacher-forced"
    verdicts, said = decisions(-0.05)
    assert verdicts == ["inferior"] * 2
    assert said.startswith("DEL at α = 0.1 is worse than MLE on digit accuracy")
    # a real but small gain: significant and inside the margin at once
    verdicts, said = decisions(+0.01, sd=0.002)
    assert verdicts == ["equivalent within ±0.025, and higher by less than the margin"] * 2
    assert said.endswith(
        "and is better by less than the margin on digit accuracy and exact match, teacher-forced"
    )
    # too few bases for too much spread: neither different nor equivalent
    verdicts, said = decisions(0.0, sd=0.05, bases=4)
    assert verdicts == ["inconclusive"] * 2 and said.startswith("no answer at this power")
    # 2 bases (CI's) make no claim, even where the two differences agree exactly
    verdicts, said = decisions(0.0, sd=0.0, bases=2)
    assert verdicts == ["no test (fewer than 3 bases)"] * 2 and said.startswith("no answer")
    # a gain at the margin's size: different, not equivalent
    verdicts, _ = decisions(+0.025, sd=0.004)
    assert verdicts == ["superior"] * 2


def test_the_endpoint_pools_the_room_tasks_per_base_and_leaves_out_the_rest():
    rows = raw_rows(runs(0.03, sd=0.0))
    last = cr.continued(rows)
    diffs = cr.differences(last, cr.PRIMARY_ARM, "digit_acc")
    assert sorted(diffs) == list(range(101, 113))
    assert all(d == pytest.approx(0.03) for d in diffs.values())  # the noisy -0.5 left out
    by_hand = statistics.fmean(
        r["digit_acc"]
        for r in last
        if r["kind"] == "del-0.1" and r["seed"] == 105 and r["task"] in cr.ROOM_TASKS
    )
    assert cr.pooled(last, "del-0.1", "digit_acc")[105] == pytest.approx(by_hand)
    # a base whose arm lacks a room task is left out of that comparison, not half-pooled
    gappy = [
        r for r in last if not (r["seed"] == 103 and r["kind"] == "mle" and r["task"] == "add")
    ]
    assert 103 not in cr.differences(gappy, cr.PRIMARY_ARM, "digit_acc")
    assert len(cr.differences(gappy, cr.PRIMARY_ARM, "digit_acc")) == 11
    # the long continuations are rows of their own, never mixed into the 300-step endpoint
    assert {r["step"] for r in last} == {300}


def test_tost_and_the_sign_flip_test_against_independent_computations():
    from scipy.stats import ttest_1samp

    rng = random.Random(5)
    for shift in (0.0, 0.01, 0.02, 0.03, -0.015):
        d = [shift + rng.gauss(0, 0.01) for _ in range(10)]
        lower = ttest_1samp([x + cr.MARGIN for x in d], 0, alternative="greater").pvalue
        upper = ttest_1samp([x - cr.MARGIN for x in d], 0, alternative="less").pvalue
        assert equivalence_p(d, cr.MARGIN) == pytest.approx(max(lower, upper), rel=1e-9)
    # exact sign flips, by hand: 3 values, 8 patterns, |sum| >= 0.6 only for +++ and ---
    assert sign_flip_p([0.1, 0.2, 0.3]) == pytest.approx(2 / 8)
    assert sign_flip_p([0.1, -0.1]) == pytest.approx(1.0)


def test_the_detectable_difference_has_its_power_by_the_noncentral_t():
    from scipy.stats import nct, t

    for n, sd in ((12, 0.007), (10, 0.012), (4, 0.007)):
        alpha = cr.FAMILY_WIDE / 2
        d = detectable_difference(sd, n, alpha, cr.POWER)
        critical = t.ppf(1 - alpha / 2, n - 1)
        power = nct.sf(critical, n - 1, d / (sd / math.sqrt(n)))
        assert power == pytest.approx(cr.POWER, abs=1e-6), (n, power)
        # TOST at the provable margin when the truth is 0 passes in 80% of samples
        m = provable_margin(sd, n, cr.EQUIVALENCE_ALPHA, cr.POWER)
        cut = t.ppf(1 - cr.EQUIVALENCE_ALPHA, n - 1)
        x = np.random.default_rng(n).normal(0.0, sd, (100_000, n))
        mean, se = x.mean(axis=1), x.std(axis=1, ddof=1) / math.sqrt(n)
        passed = ((mean + m) / se > cut) & ((m - mean) / se > cut)
        assert 0.78 < passed.mean() < 0.82, (n, passed.mean())


def test_the_planning_numbers_are_the_earlier_runs():
    """ROOM_TASKS and PLANNED (fixed in code before the run) are what `prior` computes from
    the committed earlier rows, and preregistration.md quotes prior's block as printed."""
    rows = read_raw(prior.EARLIER / "raw_runs.jsonl")
    assert tuple(prior.room_tasks(rows)) == cr.ROOM_TASKS
    assert prior.planned(rows, cr.PLANNED_BASES) == cr.PLANNED
    assert len(ex.FULL.seeds) == cr.PLANNED_BASES
    document = (ROOT / "docs" / "results" / "confirmatory" / "preregistration.md").read_text()
    assert prior.block() in document


def test_the_page_regenerates_from_its_raw_rows_with_the_runs_provenance(tmp_path):
    out = tmp_path / "report"
    page = cr.write_report(runs(0.0), out, protocol={"heldout": 200}, command="cmd", minutes=2.0)
    text = page.read_text()
    recorded = json.loads((out / "protocol.json").read_text())
    assert {"date", "machine", "commit", "minutes"} <= recorded.keys()
    assert f"`cmd`, {recorded['date']}, 2 minutes on {recorded['machine']}" in text
    assert "Greedy exact match was measured on every held-out problem (200 a task)." in text
    assert "**DEL at α = 0.1 equals MLE within ±0.025 on every primary endpoint.**" in text
    assert "| mle | 0." in text.split("long continuations")[1]  # the 1000-step rows shown
    again = tmp_path / "again"
    assert cr.main([str(out / "raw_runs.jsonl"), "--out", str(again)]) == 0
    assert (again / "report.md").read_text() == text
    # the header is the run's, not the regenerating machine's
    recorded.update(date="2001-02-03", machine="an abacus", commit="abc123")
    (out / "protocol.json").write_text(json.dumps(recorded))
    assert cr.main([str(out / "raw_runs.jsonl"), "--out", str(again)]) == 0
    assert (
        "`cmd`, 2001-02-03, 2 minutes on an abacus, commit abc123."
        in (again / "report.md").read_text()
    )


def test_the_protocol_makes_new_bases_each_continued_by_three_arms_and_one_long(tmp_path):
    protocol, data, root = ex.FULL, tmp_path / "data", tmp_path
    assert not set(protocol.seeds) & {1, 2, 3, 4}  # the earlier run's bases
    assert protocol.greedy_limit == protocol.heldout  # greedy on every held-out problem
    assert [a.name for a in protocol.arms] == ["mle", "del-0.1", "del_si-0.1"]
    runs_ = cont.continuations_of(protocol, root)
    assert len(runs_) == 12 * 3 + 3
    commands = {r.name: cont.train_command(protocol, r, data, root) for r in runs_}
    base = f"init.megatron={root / 'bases' / 'mle-101' / 'checkpoints' / 'step-0001000'}"
    long = commands["del_si-0.1@1000 seed 101"]
    assert base in long and "train.steps=1000" in long and "train.seed=2101" in long
    assert "loss.shift_invariant=true" in long and "loss.alpha=0.1" in long
    short = commands["del-0.1 seed 112"]
    assert "train.steps=300" in short and "train.seed=2112" in short
    assert "loss.shift_invariant=true" not in short
    assert len({r.directory for r in runs_}) == len(runs_)  # no two runs share a directory
    assert "long_seeds" in protocol.fingerprint()
    # the continuation experiment's protocol records what it did before long runs existed
    assert "long_seeds" not in cont.FULL.fingerprint()
    assert ex.CI.seeds and len(ex.CI.seeds) == 2 and len(ex.CI.arms) == 3
