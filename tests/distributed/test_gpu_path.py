"""The GPU path on CPU: the trainer's whole loop (train_step, evaluation, checkpoint save and
resume) under `residency.Residency`, which tells the tensors a GPU run holds in host memory
from those on the device (tests/distributed/residency.py says how), on either engine: the
deepspeed engine at data parallel 2, the megatron engine at pipeline parallel 2 in its GPU
configuration (distributed optimizer, overlapped reduction and gathering, bf16), whose
megatron-core code is judged too during each step.

Fails on the trainer before the device-resident metrics: the token count and the metric
pairs were all-reduced as host tensors (NCCL refuses them), and every micro-batch read its
metrics to the host. The resumed steps 5 and 6 run the fused output layer + loss
(`loss.fused_output`, a change a resume carries out): before the trainer promised it its
loss' own gradient (`promise_scaled_loss`), its backward read once a micro-batch, 3 reads
a step here. A checkpoint's host copy waits for the device once (checkpoint/host.py): before,
each tensor was copied to pageable memory with a blocking copy, one host synchronisation each:
39 a save on rank 0 here (the master and two moments of the 8 parameter ranges its ZeRO
partition holds, and the 15 weights it writes), 24 on rank 1."""

from __future__ import annotations

import json

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow

# the object collectives (checks, fragment tables, the data state) stage their pickles on the
# device under NCCL and read them back: theirs, not the copy of the state
OBJECT_COLLECTIVES = "/del_megatron/collectives.py:"


@pytest.mark.parametrize("engine", ["deepspeed", "megatron"])
def test_no_host_tensor_reaches_a_collective_and_one_sync_a_step(
    engine, synth_tokenizer, synth_shards, tmp_path
):
    out = tmp_path / "gpu_path"
    run_torchrun(
        "gpu_path.py", 2, str(synth_tokenizer), str(synth_shards), "del", str(out),
        "del+fused", engine, timeout=900,
    )  # fmt: skip
    for rank in (0, 1):
        report = json.loads((tmp_path / f"gpu_path.rank{rank}.json").read_text())
        assert report["violations"] == [], "\n".join(report["violations"])
        places = report["sync_places"]
        steps = {k: v for k, v in report["syncs"].items() if k.startswith("train_step#")}
        # 4 steps, then a resume at step 4 to step 6 (fused): train_step#1..#6; the one read
        # is the step's agreement (signals.agree), megatron-core's reads counted too
        calls = [f"train_step#{i}" for i in range(1, 7)]
        got = {k: report["syncs"].get(k, 0) for k in calls}
        seen = [f"{k}: {place}" for k, n in got.items() if n != 1 for place in places.get(k, [])]
        assert got == dict.fromkeys(calls, 1), f"rank {rank}: {got}\n" + "\n".join(seen)
        assert set(steps) <= set(calls)
        for phase, count in report["syncs"].items():
            if phase.startswith(("evaluate#", "flush#")):  # the values read, once
                assert count == 1, (phase, places[phase])
        # saves at steps 2, 4 and 6: every tensor's host copy queued, the device waited for
        # once (checkpoint/save.py)
        saves = [f"checkpoint.save#{i}" for i in range(1, 4)]
        assert [k for k in report["syncs"] if k.startswith("checkpoint.save#")] == saves
        for phase in saves:
            own = [p for p in places[phase] if OBJECT_COLLECTIVES not in p]
            assert [p.split(" at ")[0] for p in own] == ["runtime.synchronize"], (phase, own)
        assert len(report["losses"]) == 6
