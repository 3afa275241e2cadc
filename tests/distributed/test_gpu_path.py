"""The GPU path on CPU: the trainer's whole loop (train_step, evaluation, checkpoint save and
resume) under `residency.Residency`, which tells the tensors a GPU run holds in host memory
from those on the device (tests/distributed/residency.py says how).

Fails on the trainer before the device-resident metrics: the token count and the metric
pairs were all-reduced as host tensors (NCCL refuses them), and every micro-batch read its
metrics to the host. The resumed steps 5 and 6 run the fused output layer + loss
(`loss.fused_output`, a change a resume carries out): before the trainer promised it its
loss' own gradient (`promise_scaled_loss`), its backward read once a micro-batch, 3 reads
a step here."""

from __future__ import annotations

import json

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow


def test_no_host_tensor_reaches_a_collective_and_one_sync_a_step(
    synth_tokenizer, synth_shards, tmp_path
):
    out = tmp_path / "gpu_path"
    run_torchrun(
        "gpu_path.py", 2, str(synth_tokenizer), str(synth_shards), "del", str(out),
        "del+fused", timeout=900,
    )  # fmt: skip
    for rank in (0, 1):
        report = json.loads((tmp_path / f"gpu_path.rank{rank}.json").read_text())
        assert report["violations"] == [], "\n".join(report["violations"])
        steps = {k: v for k, v in report["syncs"].items() if k.startswith("train_step#")}
        # 4 steps, then a resume at step 4 to step 6 (fused): train_step#1..#6
        calls = [f"train_step#{i}" for i in range(1, 7)]
        got = {k: report["syncs"].get(k, 0) for k in calls}
        assert got == dict.fromkeys(calls, 1), (got, report["sync_places"])
        assert set(steps) <= set(calls)
        for phase, count in report["syncs"].items():
            if phase.startswith(("evaluate#", "flush#")):  # the values read, once
                assert count == 1, (phase, report["sync_places"][phase])
        assert len(report["losses"]) == 6
