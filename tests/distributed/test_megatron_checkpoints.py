"""Checkpoints across engines and layouts, nothing lost (CPU, gloo, <= 4 processes).

A checkpoint saved after step 2 by one engine and layout is loaded by another (workers/
megatron_checkpoints.py): every range of the fp32 masters and Adam moments the loading rank's
optimizer holds, tied copies included, equals the saved state bit for bit, with the Adam step
and the schedule's position; the run then takes steps 3-5, whose losses (1e-4 relative) and
final parameters (2e-5 absolute: 2% of one Adam step at lr 1e-3) follow the deepspeed engine's
uninterrupted single-process run, the tolerances of test_megatron_engine.py. A resume that lost
the moments or the step count (Adam's bias correction starts over) moves parameters by about
one step's size, 50 times the tolerance.

The saved and loading layouts differ in engine, pipeline split (1 + 3 layers, virtual stages),
tensor parallel (the vocabulary of 800 pads to 832 at TP 1 and 896 at TP 2) and data parallel;
EMO with tied embeddings keeps its cost embedding and the tied output layer on the last stage.
"""

from __future__ import annotations

import json

import pytest

from ..utils import assert_close
from .launcher import run_torchrun

pytestmark = pytest.mark.slow

# (processes, commands) in order: a save must come before the loads of it
SAVES = {
    "ds": (1, "deepspeed:1:1/del"),
    "ds_tied": (1, "deepspeed:1:1/emo+tied"),
    "pp": (2, "megatron:1:2/del"),
    "pp_tied": (2, "megatron:1:2/emo+tied"),
}
RESUMES = [  # (processes, loading variant, checkpoint)
    (2, "megatron:1:2/del", "ds"),  # deepspeed -> megatron PP 2 (1 + 3)
    (2, "megatron:1:2:2/del", "ds"),  # -> virtual stages
    (2, "megatron:1:2/emo+tied", "ds_tied"),  # the tied copy and the buffer onto stage 2
    (1, "deepspeed:1:1/del", "pp"),  # megatron PP 2 -> deepspeed
    (1, "deepspeed:1:1/emo+tied", "pp_tied"),
    (4, "megatron:2:2/del", "pp"),  # PP 2 -> PP 2 x TP 2 (another vocabulary padding)
    (4, "megatron:2:2/emo+tied", "pp_tied"),
    (4, "megatron:1:2/del", "ds"),  # -> PP 2 x DP 2
    (2, "deepspeed:2:1/del", "pp"),  # megatron PP 2 -> deepspeed TP 2
]


def _name(processes: int, variant: str, checkpoint: str) -> str:
    return f"resume_{variant.replace('/', '_')}_from_{checkpoint}_np{processes}.json"


@pytest.fixture(scope="module")
def resumed(synth_tokenizer, synth_shards, tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("megatron-checkpoints")
    out, init = root / "out", root / "init"
    out.mkdir()
    common = [str(synth_tokenizer), str(synth_shards), str(out), str(init)]
    saves = {
        n: [f"save:{v}:{root / name}" for name, (p, v) in SAVES.items() if p == n] for n in (1, 2)
    }
    loads = {n: [f"resume:{v}:{root / c}" for p, v, c in RESUMES if p == n] for n in (1, 2, 4)}
    # the references (megatron_engine.py's worker) and the single-process saves first
    said = run_torchrun(
        "megatron_engine.py",
        1,
        *common,
        "init",
        "deepspeed:1:1/del",
        "deepspeed:1:1/emo+tied",
    )
    said += run_torchrun("megatron_checkpoints.py", 1, *common, *saves[1])
    said += run_torchrun("megatron_checkpoints.py", 2, *common, *saves[2], *loads[2])
    said += run_torchrun("megatron_checkpoints.py", 1, *common, *loads[1])
    said += run_torchrun("megatron_checkpoints.py", 4, *common, *loads[4])
    found = {"output": said}
    for name in ("deepspeed:1:1_del.json", "deepspeed:1:1_emo+tied.json"):
        found[name] = json.loads((out / name).read_text())
        found[name]["params"] = torch.load(str(out / name) + ".pt", weights_only=True)
    for processes, variant, checkpoint in RESUMES:
        path = out / _name(processes, variant, checkpoint)
        found[processes, variant, checkpoint] = json.loads(path.read_text())
        found[processes, variant, checkpoint]["params"] = torch.load(
            str(path) + ".pt", weights_only=True
        )
    return found


@pytest.mark.parametrize(
    ("processes", "variant", "checkpoint"), RESUMES, ids=[f"{c}->{n}-{v}" for n, v, c in RESUMES]
)
def test_a_resume_at_another_engine_and_layout_continues_the_run(
    resumed, processes, variant, checkpoint
):
    kind = variant.partition("/")[2]
    want = resumed[f"deepspeed:1:1_{kind}.json"]
    got = resumed[processes, variant, checkpoint]
    what = f"{SAVES[checkpoint][1]} saved, {variant} on {processes} processes resumed"
    assert got["compared"] > 0, what  # the loaded state was compared, bit for bit
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"][2:], strict=True), start=3):
        assert abs(a - b) <= 1e-4 * abs(b), (what, step, a, b)
    assert got["params"].keys() == want["params"].keys(), what
    for name, value in want["params"].items():
        assert_close(got["params"][name], value, atol=2e-5, what=f"{what} {name}")
