"""The numeric loss hook in megatron-core's own engine, against the single-device reference
(workers/megatron_schedules.py: one launch of 2 ranks on gloo checks every item):
`get_forward_backward_func()` at TP 2, DP 2, PP 2 (4 layers split 1 + 3) and virtual PP
2x2, and EMO on a pipeline with tied embeddings, each with megatron's DistributedDataParallel,
`finalize_model_grads` and optimizer; losses, gradients, gradient norms and the weights
after two steps compared; EMO's cost embedding through megatron's dist_checkpointing at TP 2;
where the installed megatron-core ships `megatron.training` (0.17+), Megatron-LM's own
`train_step` on the config-container form of its model with `numeric_loss_hook`; and where
Megatron-Bridge is installed, Bridge's own `train_step` on a recipe's config whose model is
`NumericLossGPTModelProvider` of AutoBridge's provider, with `megatron_bridge.forward_step`."""

from __future__ import annotations

import importlib.util

import pytest

from del_megatron.losses import REPORT_PAIRS

from .launcher import run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

LAYOUTS = ["tp2", "dp2", "pp2", "vpp2x2", "pp2+emo+tied"]


def test_megatrons_schedules_give_the_reference_loss_and_gradients(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    checks = [*LAYOUTS, f"emo-checkpoint={tmp_path / 'checkpoint'}"]
    megatron_training = importlib.util.find_spec("megatron.training") is not None
    if megatron_training:
        checks.append("megatron-lm")
    bridge = importlib.util.find_spec("megatron.bridge") is not None
    if bridge:
        (tmp_path / "hf").mkdir()
        checks.append(f"megatron-bridge={tmp_path / 'hf'}")
    output = run_torchrun("megatron_schedules.py", 2, *checks)
    for layout in LAYOUTS:
        assert f"OK {layout}:" in output
    # the head only on the last pipeline stage (rank 1), for every kind
    assert output.count("OK pp2: 8 parameters, 0 head(s); 23 parameters, 1 head(s)") == 1
    assert "OK pp2+emo+tied: 8 parameters, 0 head(s); 23 parameters, 1 head(s)" in output
    assert "OK vpp2x2: 15 parameters, 0 head(s); 16 parameters, 1 head(s)" in output
    assert "OK emo-checkpoint:" in output
    # megatron_report's keys, in its order: 'lm loss' (CE), 'objective', then every report
    # pair but CE; derived from REPORT_PAIRS so a metric added to the loss is checked here too
    keys = ["lm loss", "objective", *(k for k in REPORT_PAIRS if k != "ce")]
    report = f"{len(keys)} report keys: {', '.join(keys)}"
    assert (f"OK megatron-lm: {report}; {report}\n" in output) == megatron_training
    assert (f"OK megatron-bridge: {report}; {report}\n" in output) == bridge
