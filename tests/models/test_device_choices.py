"""The model's device-dependent choices made by models/spec.py and runtime.py from the run's
device, never by what megatron found importable, and its probes agreed without a tensor of
the probed device.

Three classes, each failing on the code before:

* Every megatron module whose implementation megatron picks at import time is named by the
  device module. The decoder's final norm was megatron's own import-time choice
  (`transformer_block.LayerNormImpl`: TE's, else Apex's, else torch's) on every device.
  `test_a_cpu_build_ignores_megatrons_import_time_norm` failed with "AssertionError:
  (RMSNorm) is not supported in FusedLayerNorm" (an image with Apex and no TE) and with the
  TE stand-in's error (a TE image running train.device=cpu); the CUDA spec test found the
  final norm absent from what the device module chose.
* "Available" means megatron itself uses it. `import transformer_engine` succeeds when TE's
  PyTorch part does not import (TE's `__init__` swallows that ImportError); megatron then
  has HAVE_TE False, and the TE spec and `apply_rope_fusion` chosen here made
  TransformerConfig raise. `test_transformer_engine_is_what_megatron_found` failed: True.
* A probe's agreement hands no group a tensor of the probed device. del-eval's one-process
  group was gloo while its model built on CUDA, and `compile_probe`'s agreement all-reduced
  a CUDA tensor there (`CollectiveDeviceError: all_reduce: a cuda tensor handed to a gloo
  group`). A meta tensor stands in for the CUDA one under gloo:
  `test_the_probes_agreement_takes_no_tensor_of_the_device` failed with "all_reduce: a meta
  tensor handed to a gloo group" (with and without DEL_COLLECTIVES_ON_ONE_RANK).

And MFU's peak is the device's by its exact name: by substring, an H100 PCIe and an H100 NVL
got the SXM part's peak (`test_peak_flops_by_the_exact_device_name` failed for both).
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from del_megatron import runtime
from del_megatron.models import spec as device

CPU = torch.device("cpu")


def test_transformer_engine_is_what_megatron_found(monkeypatch):
    """A `transformer_engine` that imports while its PyTorch part does not (here: a module
    with no `pytorch`, as TE's `__init__` leaves it): not available, as megatron's HAVE_TE."""
    from megatron.core.extensions import transformer_engine as te_extension

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    import transformer_engine  # noqa: F401  (the weak test's import succeeds)

    assert not te_extension.HAVE_TE
    assert device.transformer_engine_available() is False
    # so a CUDA build picks megatron's local spec and no TE fusion
    assert not device.uses_transformer_engine(torch.device("cuda"))
    monkeypatch.setattr(device, "compile_probe", lambda _type: None)
    assert not device.transformer_config_overrides(torch.device("cuda"))["apply_rope_fusion"]


class TEOnTheCPU(torch.nn.Module):
    """What TE's norm does with CPU parameters at its first forward."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("Transformer Engine: expected a CUDA tensor (TENorm on the CPU)")


@pytest.mark.parametrize("imported", ["apex", "transformer_engine"])
def test_a_cpu_build_ignores_megatrons_import_time_norm(imported, monkeypatch, one_process_groups):
    """megatron's import-time choices set as an image with Apex (no TE) or with TE makes them;
    the CPU build's every norm is torch's, and no module comes from TE or Apex."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    from del_megatron import DigitVocab, NumericLossConfig
    from del_megatron.models.architecture import LlamaArchitecture
    from del_megatron.models.llama import build_llama

    chosen = FusedLayerNorm if imported == "apex" else TEOnTheCPU
    monkeypatch.setattr(transformer_block, "LayerNormImpl", chosen)
    monkeypatch.setattr(gpt_layer_specs, "LNImpl", chosen)
    arch = LlamaArchitecture(
        vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4,
        num_query_groups=2, max_position_embeddings=16, make_vocab_size_divisible_by=64,
    )  # fmt: skip
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=64)
    model = build_llama(arch, vocab, NumericLossConfig(kind="mle"), CPU, seed=0)
    assert type(model.decoder.final_layernorm) is torch.nn.RMSNorm
    foreign = [
        f"{name}: {type(m).__module__}.{type(m).__name__}"
        for name, m in model.named_modules()
        if type(m).__module__.startswith(("megatron.core.extensions", "apex", "transformer_engine"))
        or isinstance(m, FusedLayerNorm)
    ]
    assert foreign == []
    tokens = torch.randint(0, 64, (1, 8))
    assert model(tokens, torch.arange(8)[None], None).shape == (1, 8, 64)


@pytest.mark.parametrize("te", [True, False])
def test_a_cuda_decoder_names_every_norm(te, monkeypatch):
    """CUDA: TE's spec and TE's final norm where megatron runs TE; else the local spec with
    torch's norms and SDPA, whatever megatron's import-time norm (Apex's here)."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    monkeypatch.setattr(transformer_block, "LayerNormImpl", FusedLayerNorm)
    monkeypatch.setattr(device, "transformer_engine_available", lambda: te)
    te_spec = object()  # megatron's TE layer spec (it needs TE installed to be built)
    monkeypatch.setattr(
        gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda **_: te_spec
    )
    spec = device.gpt_decoder_spec(torch.device("cuda"), 3)
    assert len(spec.layer_specs) == 3
    assert spec.layer_norm is (TENorm if te else WrappedTorchNorm)
    if te:
        assert spec.layer_specs == [te_spec] * 3
    else:
        layer = spec.layer_specs[0].submodules
        attention = layer.self_attention.submodules
        assert attention.core_attention is device.SDPACoreAttention
        assert layer.input_layernorm is layer.pre_mlp_layernorm is WrappedTorchNorm
    cpu = device.gpt_decoder_spec(CPU, 1)
    assert cpu.layer_norm is WrappedTorchNorm
    assert cpu.layer_specs[0].submodules.self_attention.submodules.core_attention is (
        device.SDPACoreAttention
    )


@pytest.mark.parametrize("switch", ["0", "1"])
@pytest.mark.parametrize("fails", [False, True])
def test_the_probes_agreement_takes_no_tensor_of_the_device(switch, fails, group, monkeypatch):
    """compile_probe on a device the one-process gloo group does not take (meta, for CUDA):
    its answer is agreed without handing the group a tensor of that device."""
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    from del_megatron import collectives

    monkeypatch.setenv(collectives.ON_ONE_RANK, switch)

    def swiglu(x, bias):
        if fails:
            raise RuntimeError("no C compiler")
        return x[..., : x.shape[-1] // 2]

    monkeypatch.setattr(fused_bias_swiglu, "bias_swiglu_impl", swiglu)
    monkeypatch.setattr(
        fused_bias_dropout, "bias_dropout_add_fused_train", lambda xb, residual, p: xb[0] + residual
    )
    monkeypatch.setattr(device, "synchronize", lambda _device: None)
    found = device.compile_probe.__wrapped__("meta")
    assert found == ("RuntimeError: no C compiler" if fails else None)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),  # before: the SXM part's 989 (MFU understated 1.31x)
        ("NVIDIA H100 NVL", 835e12),  # before: 989 (1.18x)
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 SXM5 94GB", None),  # a name not in the table: no MFU, not a guess
    ],
)
def test_peak_flops_by_the_exact_device_name(name, peak, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: name)
    assert runtime.peak_flops(torch.device("cuda")) == peak
    assert runtime.peak_flops(CPU) is None


def test_train_deterministic_makes_torch_deterministic(monkeypatch):
    """train.deterministic (what the GPU acceptance's bit-for-bit resume runs with): torch's
    deterministic kernels, cuBLAS's workspace fixed; off, nothing changes."""
    from del_megatron.config import TrainConfig

    train = {"steps": 1, "micro_batch_size": 1, "global_batch_size": 1, "seq_len": 8}
    assert not TrainConfig(**train).deterministic  # off by default
    assert TrainConfig(**train, deterministic=True).deterministic
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    runtime.deterministic_algorithms(False)
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        runtime.deterministic_algorithms(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
