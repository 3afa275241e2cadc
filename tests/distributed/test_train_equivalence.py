"""Equivalence: 5 optimizer steps at TP 2 x DP 2 (4 processes) with ZeRO 1, 2 and 3 follow
TP 1 x DP 1 with the whole global batch as one micro-batch: each step's loss and gradient
norm before clipping within 1e-4 relative (Adam would hide a wrong constant gradient scale in
the losses; the norm shows it), and every parameter after the last step within 2e-5
absolute, 2% of one Adam step at lr 1e-3 (float32 reduction order gives up to 4.4e-6; a shard
that misses an update, or gets one twice, is off by up to the lr).

Rows keep between 3% and 100% of their targets (workers/train_equivalence.py), so the four
micro-batches of 2 rows, and the two data-parallel ranks, differ in token counts: a loss
normalised per micro-batch or per rank, not over the global batch's tokens, misses the
reference, which sees one micro-batch. With `normalize: tokens`, the one normalisation under
which the objective does not depend on how the global batch is cut (with `digits`, the
default, each micro-batch's numeric part is divided by its own digit count, as in the DEL
authors' code: docs/losses.md). The three stages (and the fused path at ZeRO 1) run in one
4-process torchrun."""

from __future__ import annotations

import json

import pytest

from ..utils import assert_close
from .launcher import run_torchrun

pytestmark = pytest.mark.slow

KIND = "del+tokens"
TP2_DP2 = [f"{KIND}:1", f"{KIND}:2", f"{KIND}:3", f"{KIND}+fused:1"]


def load(out):
    import torch

    trajectory = json.loads(out.read_text())
    trajectory["params"] = torch.load(str(out) + ".pt", weights_only=True)
    return trajectory


def trajectories(tokenizer, shards, out_dir, tp: int, processes: int, variants: list[str]):
    out_dir.mkdir(parents=True, exist_ok=True)
    run_torchrun(
        "train_equivalence.py", processes, str(tokenizer), str(shards), str(tp), str(out_dir),
        *variants,
    )  # fmt: skip
    return {v: load(out_dir / f"{v}.json") for v in variants}


@pytest.fixture(scope="module")
def reference(synth_tokenizer, synth_shards, tmp_path_factory):
    """TP 1 x DP 1, ZeRO 1 (with DP 1 it partitions nothing), one micro-batch of 8 rows."""
    root = tmp_path_factory.mktemp("equiv-tp1")
    variant = f"{KIND}:1:8"
    return trajectories(synth_tokenizer, synth_shards, root, 1, 1, [variant])[variant]


@pytest.fixture(scope="module")
def tp2_dp2(synth_tokenizer, synth_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("equiv-tp2-dp2")
    return trajectories(synth_tokenizer, synth_shards, root, 2, 4, TP2_DP2)


def assert_follows(got, want, rel: float, atol: float, what: str):
    assert len(got["losses"]) == len(want["losses"]) == 5, what
    assert got["losses"][-1] < got["losses"][0], what  # it trains
    for key in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(a - b) <= rel * abs(b), (what, key, step, a, b)
    assert got["params"].keys() == want["params"].keys(), what
    for name, value in want["params"].items():
        assert_close(got["params"][name], value, atol=atol, what=f"{what} {name}")


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tp2_dp2_zero_matches_tp1_dp1(reference, tp2_dp2, zero):
    assert_follows(tp2_dp2[f"{KIND}:{zero}"], reference, 1e-4, 2e-5, f"TP 2 x DP 2 ZeRO {zero}")
    # MFU's FLOPs per token, Megatron-LM's count from the architecture (h 64, q 64, kv 32, ffn
    # 160, 2 layers, V 800, s 32), at every stage and layout (ZeRO 3 empties the parameters a
    # count after deepspeed.initialize would read; a rank holds a share of them)
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 160
    assert reference["flops_per_token"] == 6 * (2 * layer + 64 * 800) + 6 * 2 * 64 * 32
    assert tp2_dp2[f"{KIND}:{zero}"]["flops_per_token"] == reference["flops_per_token"]


def test_the_collective_timeout_reaches_every_group(reference, tp2_dp2):
    """parallel.collective_timeout_minutes (17 in the worker's config) is the timeout of the
    process group and of megatron-core's groups, read back from their backends (before:
    DeepSpeed's 10 minutes and megatron's 30)."""
    for got in [reference, *tp2_dp2.values()]:
        assert got["timeout_minutes"] == dict.fromkeys(("world", "data", "tensor", "model"), 17)


def test_fused_output_follows_the_unfused_trajectory(tp2_dp2):
    """loss.fused_output at TP 2 x DP 2, ZeRO 1: the same 5 steps as the unfused path on the
    same layout, within 1e-5 relative (float32; only the order of float32 sums differs)."""
    got, want = tp2_dp2[f"{KIND}+fused:1"], tp2_dp2[f"{KIND}:1"]
    assert_follows(got, want, 1e-5, 1e-5, "fused TP 2 x DP 2")


@pytest.mark.parametrize("zero", [1, 3])
def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(zero, synth_tokenizer, synth_shards):
    out = run_torchrun("train_nonfinite.py", 1, str(synth_tokenizer), str(synth_shards), str(zero))
    assert "OK 3 optimizer steps in a row" in out


def test_the_megatron_engine_skips_nonfinite_steps_on_every_stage(synth_tokenizer, synth_shards):
    """train.engine=megatron at PP 2: the NaN loss exists on the last stage only; the first
    stage's weights stay unchanged across the skipped steps too (the agreement)."""
    args = (str(synth_tokenizer), str(synth_shards), "1", "megatron")
    out = run_torchrun("train_nonfinite.py", 2, *args)
    assert "OK 3 optimizer steps in a row" in out
