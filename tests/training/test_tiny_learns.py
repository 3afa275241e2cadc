"""The tiny CPU default learns: a shortened run of configs/tiny_cpu.yaml through del-train
(torchrun, TP 2) lowers the held-out loss and raises held-out digit accuracy."""

from __future__ import annotations

import re

import pytest

from data_tools.build import build_shards

from ..distributed.launcher import ROOT, run_torchrun

pytestmark = pytest.mark.slow

STEPS = 80
# Margins, from runs of this test: held-out loss 6.9 -> ~2.2, digit accuracy ~0.00 -> ~0.10
MIN_LOSS_DROP = 3.0
MIN_DIGIT_ACC_GAIN = 0.05


def test_shortened_tiny_run_learns(tmp_path, synth_corpus, synth_tokenizer, synth_shards):
    heldout = build_shards(
        [synth_corpus / "heldout.jsonl"], tmp_path / "heldout", synth_tokenizer, progress=False
    )
    assert heldout.documents == 50
    out = run_torchrun(
        "-m del_megatron.cli.train",
        2,
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        f"data.tokenizer={synth_tokenizer}",
        f"data.sources=[{{manifest: {synth_shards}}}]",
        f"eval.sources=[{{manifest: {tmp_path / 'heldout' / 'manifest.json'}}}]",
        f"train.steps={STEPS}",
        "train.log_interval=20",
        "logging.wandb=offline",
        f"output_dir={tmp_path / 'run'}",
    )
    table = {
        m[0]: (float(m[1]), float(m[2]))
        for m in re.findall(
            r"^(held-out CE|held-out loss \(CE \+ 0\.1·del\)|digit accuracy|digit entropy)"
            r"\s+(\S+)\s+(\S+)$",
            out,
            flags=re.M,
        )
    }
    expected = {"held-out CE", "held-out loss (CE + 0.1·del)", "digit accuracy", "digit entropy"}
    assert set(table) == expected, out[-3000:]
    loss_before, loss_after = table["held-out loss (CE + 0.1·del)"]
    acc_before, acc_after = table["digit accuracy"]
    assert loss_before - loss_after >= MIN_LOSS_DROP, table
    assert acc_after - acc_before >= MIN_DIGIT_ACC_GAIN, table
    # never silent for long: each slow part is announced, in order, before the first step line
    said = [
        "del-train: building the model and DeepSpeed (ZeRO 1) on 2 rank(s)",
        "parameters); starting DeepSpeed's engine",  # the half minute after it, said
        "del-train: held-out evaluation before training (20 batches at most)",
        f"del-train: training steps 1-{STEPS}, a line every 20",
        f"step 20/{STEPS}",
        "del-train: held-out evaluation after training",
        "next:",
    ]
    places = [out.find(line) for line in said]
    assert -1 not in places and places == sorted(places), list(zip(said, places, strict=True))
    # console lines, a checkpoint, and an offline wandb run
    assert re.search(r"step 80/80 \| loss \S+ \| ce \S+ \| numeric \S+ \| digit_acc", out)
    assert (tmp_path / "run" / "checkpoints" / f"step-{STEPS:07d}" / "run_config.yaml").is_file()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
