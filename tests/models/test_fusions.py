"""megatron's fusion flags: on only where they work, each with its reason.

In megatron-core 0.16 `bias_activation_fusion` and `bias_dropout_fusion` go through
`megatron.core.jit.jit_fuser`, which is `torch.compile`: every process compiles with
Inductor and Triton at its first step, which needs a C compiler and Python's headers on
every node. Before, the device module turned both on for every CUDA run
(`test_cuda_overrides_follow_the_probe` failed on the old code: bias_activation_fusion was
True with the probe failing).
"""

from __future__ import annotations

import pytest
import torch

from del_megatron.models import spec as device
from del_megatron.models.spec import COMPILED_FUSIONS, FUSION_FLAGS, choose_fusions

ERROR = "BackendCompilerFailed: backend='inductor' raised: CalledProcessError: gcc not found"


@pytest.mark.parametrize(
    ("device_type", "te", "error", "on"),
    [
        ("cuda", False, None, {"bias_activation_fusion", "bias_dropout_fusion"}),
        ("cuda", True, None, {*COMPILED_FUSIONS, "apply_rope_fusion", "masked_softmax_fusion"}),
        ("cuda", False, ERROR, set()),
        ("cuda", True, ERROR, {"apply_rope_fusion", "masked_softmax_fusion"}),
        ("cpu", True, None, set()),
    ],
)
def test_choice(device_type, te, error, on):
    chosen = choose_fusions(device_type, transformer_engine=te, compile_error=error)
    assert {n for n, v in chosen.flags.items() if v} == on
    assert set(chosen.flags) == set(chosen.reasons) == set(FUSION_FLAGS)
    lines = chosen.lines()
    assert len(lines) == len(FUSION_FLAGS) and all("\n" not in line for line in lines)
    if error is not None:  # the reason a compiled fusion is off names the compiler's error
        assert all(error in chosen.reasons[n] for n in COMPILED_FUSIONS)
        assert "bias_dropout_fusion off: torch.compile fails here (" + ERROR in lines[1]


def test_cuda_overrides_follow_the_probe(monkeypatch):
    monkeypatch.setattr(device, "transformer_engine_available", lambda: False)
    monkeypatch.setattr(device, "compile_probe", lambda _type: ERROR)
    overrides = device.transformer_config_overrides(torch.device("cuda"))
    assert not any(overrides[n] for n in FUSION_FLAGS), overrides
    monkeypatch.setattr(device, "compile_probe", lambda _type: None)
    overrides = device.transformer_config_overrides(torch.device("cuda"))
    assert {n for n in FUSION_FLAGS if overrides[n]} == set(COMPILED_FUSIONS)


def test_probe_reports_what_the_compiler_raised_in_one_line(monkeypatch):
    from megatron.core.fusions import fused_bias_swiglu

    def fails(*_args, **_kwargs):
        raise RuntimeError("Inductor: no working C compiler\nsee the log")

    monkeypatch.setattr(fused_bias_swiglu, "bias_swiglu_impl", fails)
    found = device.compile_probe.__wrapped__("cpu")  # uncached: this process's answer stays
    assert found == "RuntimeError: Inductor: no working C compiler see the log"


def test_dry_run_on_a_gpu_node_names_each_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "transformer_engine_available", lambda: False)
    monkeypatch.setattr(device, "compile_probe", lambda _type: ERROR)
    lines = device.planned_fusions("cuda")
    assert lines[0].startswith(f"bias_activation_fusion off: torch.compile fails here ({ERROR}")
    assert "apply_rope_fusion off: needs TE" in lines
