"""bench/train_step.py times DEL against MLE in one run: its two variants really run different
losses. The MLE steps report no numeric term (nan: nothing to average), the DEL steps a
positive one. Before, the bench set `model.loss_config`, which nothing read: both variants
ran DEL and the printed ratio was 1 by construction."""

from __future__ import annotations

import math
import re

import pytest

from ..distributed.launcher import ROOT, run_torchrun

pytestmark = pytest.mark.slow


def test_the_two_variants_run_their_own_loss(synth_tokenizer):
    bench = str(ROOT / "bench" / "train_step.py")
    args = ("--steps", "1", "--warmup", "0", "--tokenizer", str(synth_tokenizer))
    out = run_torchrun(bench, 2, *args, timeout=600)
    rows = {words[0]: words for words in (line.split() for line in out.splitlines()) if words}
    numeric = {kind: float(rows[kind][-1]) for kind in ("mle", "del")}
    assert math.isnan(numeric["mle"]), out[-2000:]
    assert numeric["del"] > 0, out[-2000:]


def test_the_two_engines_run_the_same_step(synth_tokenizer):
    """--engines: deepspeed's and megatron's runs, from one seed on the same batches,
    report the same loss after their last step (each timed its own step); each row has the
    trainer's TFLOP/s and MFU (none on CPU: nan), and a last line puts megatron's figures
    over deepspeed's side by side (what bench/gpu_acceptance.py's bench-engines reads)."""
    bench = str(ROOT / "bench" / "train_step.py")
    args = ("--engines", "--steps", "2", "--warmup", "0", "--tokenizer", str(synth_tokenizer))
    out = run_torchrun(bench, 2, *args, timeout=600)
    # engine, step ms, ratio, tokens/s, trainer, TFLOP/s, MFU, loss
    rows = {words[0]: words for words in (line.split() for line in out.splitlines())
            if len(words) == 8 and words[0] in ("deepspeed", "megatron")}  # fmt: skip
    losses = {engine: float(rows[engine][-1]) for engine in ("deepspeed", "megatron")}
    assert abs(losses["deepspeed"] - losses["megatron"]) <= 1e-4 * losses["deepspeed"], out[-2000:]
    assert rows["megatron"][2].endswith("x"), out[-2000:]  # its ratio to deepspeed
    assert all(float(rows[e][4]) > 0 for e in rows), out[-2000:]  # the trainer's tokens/s
    assert all(math.isnan(float(rows[e][k])) for e in rows for k in (5, 6)), out[-2000:]
    ratios = re.search(r"^megatron / deepspeed: tokens/s ([0-9.]+)x \(timed\), ([0-9.]+)x "
                       r"\(trainer\), TFLOP/s nanx, MFU nanx$", out, re.M)
    assert ratios, out[-2000:]
    timed = float(rows["megatron"][3]) / float(rows["deepspeed"][3])
    assert abs(float(ratios[1]) - timed) <= 2e-3 * timed, (ratios[0], timed)  # rounding
