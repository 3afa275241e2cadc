"""Equivalence: 5 optimizer steps at TP 2 x DP 2 (4 processes) with ZeRO 1, 2 and 3 follow
TP 1 x DP 1 on the same global batches: each step's loss and gradient norm before clipping
within 1e-4 relative (Adam would hide a wrong constant gradient scale in the losses; the norm
shows it), and every parameter after the last step within 2e-5 absolute, 2% of one Adam step
at lr 1e-3 (float32 reduction order gives up to 4.4e-6; a shard that misses an update, or
gets one twice, is off by up to the lr)."""

from __future__ import annotations

import json

import pytest

from ..utils import assert_close
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
    return load(out)


def load(out):
    import torch

    trajectory = json.loads(out.read_text())
    trajectory["params"] = torch.load(str(out) + ".pt", weights_only=True)
    return trajectory


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
    got = load(out)
    assert len(got["losses"]) == len(reference["losses"]) == 5
    assert got["losses"][-1] < got["losses"][0]  # it trains
    for key in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(got[key], reference[key], strict=True)):
            assert abs(a - b) <= 1e-4 * abs(b), (key, step, a, b)
    assert got["params"].keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        assert_close(got["params"][name], want, atol=2e-5, what=name)


@pytest.mark.parametrize("zero", [1, 3])
def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(zero, synth_tokenizer, synth_shards):
    out = run_torchrun("train_nonfinite.py", 1, str(synth_tokenizer), str(synth_shards), str(zero))
    assert "OK 3 optimizer steps in a row" in out


@pytest.fixture(scope="module")
def unfused_tp2_dp2(synth_tokenizer, synth_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("equiv") / "unfused.json"
    run_torchrun(
        "train_equivalence.py",
        4,
        str(synth_tokenizer),
        str(synth_shards),
        "2",
        "1",
        "del",
        str(out),
    )
    return load(out)


def test_fused_output_follows_the_unfused_trajectory(
    unfused_tp2_dp2, synth_tokenizer, synth_shards, tmp_path
):
    """loss.fused_output at TP 2 x DP 2, ZeRO 1: the same 5 steps as the unfused path on the
    same layout, within 1e-5 relative (float32; only the order of float32 sums differs)."""
    out = tmp_path / "fused.json"
    run_torchrun(
        "train_equivalence.py",
        4,
        str(synth_tokenizer),
        str(synth_shards),
        "2",
        "1",
        "del+fused",
        str(out),
    )
    got = load(out)
    for key in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(got[key], unfused_tp2_dp2[key], strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), (key, step, a, b)
    for name, want in unfused_tp2_dp2["params"].items():
        assert_close(got["params"][name], want, atol=1e-5, what=name)
