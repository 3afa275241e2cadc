"""The continuation experiment (experiments/continuations/run.py) and its pre-registered
analysis (experiments/continuations/report.py): the trend test against an independent least
squares fit, Holm over the primary endpoints, a page that claims only what survives and
states its power, regenerated from its raw rows; the continuations' commands. The whole
pipeline on real training runs is CI's (`launch/experiments/continuations.sh --ci`)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from experiments.continuations import report as cr
from experiments.continuations import run as ex

TASKS = {"add": "hard", "subtract": "hard", "multiply": "hard", "noisy": "easy"}


def test_trend_equals_least_squares_with_one_intercept_per_seed():
    rng = random.Random(3)
    points = []
    for seed in (1, 2, 3, 4):
        offset = rng.uniform(-1, 1)
        for alpha in ex.ALPHAS:
            points.append(
                (seed, math.log10(alpha), offset + 0.2 * math.log10(alpha) + rng.gauss(0, 0.05))
            )
    t = cr.trend(points, tests=7)
    design = np.array([[1.0 * (s == k) for k in (1, 2, 3, 4)] + [x] for s, x, _ in points])
    y = np.array([v for *_, v in points])
    coef, residual, *_ = np.linalg.lstsq(design, y, rcond=None)
    df = len(points) - 5
    se = math.sqrt(residual[0] / df * np.linalg.inv(design.T @ design)[4, 4])
    assert t.slope == pytest.approx(coef[4], abs=1e-12) and t.df == df == 11
    assert t.se == pytest.approx(se, rel=1e-9)
    assert t.p < 1e-6 and t.mde > 2 * t.se  # t quantiles at 0.05 / 7 and 80% power
    assert not math.isnan(cr.trend(points[:8], tests=7).p)  # 2 seeds x 4 alphas: df 5
    assert math.isnan(cr.trend(points[:5], tests=7).p)  # 5 points, 2 seeds: df 2, no test


def fake_run(kind: str, seed: int, family: str, alpha: float, slope: float) -> dict:
    """Made-up metrics: a base effect per seed shared by every arm, DEL's digit accuracy on
    add rising by `slope` per decade of alpha, everything else noise only."""
    base = random.Random(seed).uniform(-0.1, 0.1)
    noise = random.Random(f"{kind}-{seed}")
    x = math.log10(alpha) if family else 0.0
    tasks = {}
    for task, level in TASKS.items():
        effect = slope * (x + 1) if (family == "del" and task == "add") else 0.0
        tasks[task] = {
            "level": level,
            "digit_acc": 0.4 + base + effect + noise.gauss(0, 0.01),
            "entropy_gap": 0.3 + base + noise.gauss(0, 0.02),
            "answer_loss": 1.0 + base + noise.gauss(0, 0.02),
            "digit_ece": 0.05,
            "exact_greedy": 0.1,
            "number_mae": 3.0,
        }
    curve = [{"step": 10, "tasks": tasks}]
    train = [
        {"step": s, "digit_logsumexp": 5.0 - s / 10 * (alpha if family else 0)} for s in (1, 25)
    ]
    return {
        "kind": kind,
        "loss_kind": "del" if family else "mle",
        "family": family,
        "alpha": alpha,
        "seed": seed,
        "curve": curve,
        "train_curve": train,
    }


def runs(slope: float) -> list[dict]:
    out = []
    for seed in (1, 2, 3, 4):
        out.append(fake_run("mle", seed, "", math.nan, 0))
        out.append(fake_run("placebo", seed, "", math.nan, 0))
        for alpha in ex.ALPHAS:
            out.append(fake_run(f"del-{alpha:g}", seed, "del", alpha, slope))
            out.append(fake_run(f"del_si-{alpha:g}", seed, "del_shift_invariant", alpha, 0))
    return out


def test_the_page_claims_what_survives_holm_and_regenerates_from_raw_rows(tmp_path):
    out = tmp_path / "report"
    page = cr.write_report(runs(0.05), out, protocol={"steps": 10}, command="cmd", minutes=1.0)
    text = page.read_text()
    said = "survives Holm's correction on 1 of 7 primary endpoints: add: digit accuracy"
    assert f"{said} (up with α, as DEL's claim predicts)." in text
    primary = text.split("## Pre-registered")[1].split("## The digit logits")[0]
    starred = [line for line in primary.splitlines() if line.startswith("|") and "✱" in line]
    assert len(starred) == 1, primary
    (line,) = starred
    slope = float(line.split("|")[2].split()[0])
    assert line.startswith("| add: digit accuracy |") and slope == pytest.approx(0.05, abs=0.01)
    assert "No trend of the shift-invariant arm passes Holm" in text
    for plot in ("logit_level.png", "dose_response.png"):
        assert (out / plot).stat().st_size > 1000
    again = tmp_path / "again"
    assert cr.main([str(out / "raw_runs.jsonl"), "--out", str(again)]) == 0
    assert (again / "report.md").read_text() == text


def test_no_effect_is_stated_with_its_power(tmp_path):
    text = cr.write_report(runs(0.0), tmp_path, protocol={}, command="cmd", minutes=1.0).read_text()
    assert "No primary endpoint's trend survives Holm's correction." in text
    assert "absence of evidence at this power, not evidence of no effect" in text
    assert "cannot be seen here" in text


def test_every_arm_of_a_base_continues_its_weights_on_one_data_order(tmp_path):
    protocol = ex.FULL
    data, root = tmp_path / "data", tmp_path
    commands = {
        run.name: run_command
        for run in ex.continuations_of(protocol, root)
        for run_command in [ex.train_command(protocol, run, data, root)]
    }
    assert len(commands) == 4 * 12
    base = f"init.megatron={root / 'bases' / 'mle-2' / 'checkpoints' / 'step-0001000'}"
    of_seed_2 = [c for name, c in commands.items() if name.endswith("seed 2")]
    assert all(base in c and "train.seed=2002" in c and "train.steps=300" in c for c in of_seed_2)
    assert "loss.shift_invariant=true" in commands["del_si-0.3 seed 1"]
    assert "loss.alpha=0.3" in commands["del_si-0.3 seed 1"]
    assert "optim.lr=0.0011" in commands["placebo seed 1"]
    assert "optim.lr=0.001" in commands["mle seed 1"]
    assert "loss.shift_invariant=true" not in commands["del-3 seed 1"]
    (bases,) = {
        tuple(ex.train_command(protocol, b, data, root)[-3:])
        for b in ex.bases_of(protocol, root)[:1]
    }
    assert "train.steps=1000" in bases
    json.dumps(protocol.fingerprint())  # recorded in protocol.json


def test_the_committed_page_regenerates_from_its_raw_rows(tmp_path):
    """docs/results/continuations/: the page is what its raw rows and protocol.json make."""
    from ..distributed.launcher import ROOT

    committed = ROOT / "docs" / "results" / "continuations"
    assert cr.main([str(committed / "raw_runs.jsonl"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == (committed / "report.md").read_text()
