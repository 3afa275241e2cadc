"""The megatron engine's gradient-accumulation fusion: on a GPU where megatron found its
kernel (Apex's fused_weight_gradient_mlp_cuda), as Megatron-LM runs it (the weight gradient
summed into megatron's float32 main_grad inside the GEMM); never on CPU, never on the deepspeed
engine, which has no main_grad. Failed on the code before: off for both engines, the reason
given being DeepSpeed's (issue 50, item 5)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import layers

from del_megatron.models.spec import choose_fusions
from del_megatron.training.engines.megatron import fusion_overrides

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("kernel", [True, False])
def test_on_where_megatron_found_its_kernel(kernel, monkeypatch):
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", kernel)
    assert fusion_overrides(CUDA).get("gradient_accumulation_fusion", False) is kernel
    assert fusion_overrides(CPU) == {}


def test_the_deepspeed_engines_models_keep_it_off():
    fusions = choose_fusions("cuda", transformer_engine=True, compile_error=None)
    assert fusions.flags["gradient_accumulation_fusion"] is False
    assert "megatron engine turns it on" in fusions.reasons["gradient_accumulation_fusion"]
