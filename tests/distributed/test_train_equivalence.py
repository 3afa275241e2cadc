"""Equivalence: 5 optimizer steps at TP 2 x DP 2 (4 processes) with ZeRO 1, 2 and 3 follow
the loss trajectory of TP 1 x DP 1 on the same global batches, within 1e-4 relative."""

from __future__ import annotations

import json

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(synth_tokenizer, synth_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("equiv") / "tp1.json"
    run_torchrun(
        "train_equivalence.py",
        1,
        str(synth_tokenizer),
        str(synth_shards),
        "1",  # TP 1
        "1",  # ZeRO 1 (with DP 1 it partitions nothing)
        "del",
        str(out),
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tp2_dp2_zero_matches_tp1_dp1(reference, zero, synth_tokenizer, synth_shards, tmp_path):
    out = tmp_path / f"zero{zero}.json"
    run_torchrun(
        "train_equivalence.py",
        4,
        str(synth_tokenizer),
        str(synth_shards),
        "2",
        str(zero),
        "del",
        str(out),
    )
    losses = json.loads(out.read_text())
    assert len(losses) == len(reference) == 5
    assert losses[-1] < losses[0]  # it trains
    for step, (got, want) in enumerate(zip(losses, reference, strict=True)):
        assert abs(got - want) <= 1e-4 * abs(want), (step, got, want)


@pytest.mark.parametrize("zero", [1, 3])
def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(zero, synth_tokenizer, synth_shards):
    out = run_torchrun("train_nonfinite.py", 1, str(synth_tokenizer), str(synth_shards), str(zero))
    assert "OK 3 optimizer steps in a row" in out
