"""The model's specification on a device: the TransformerConfig fields that depend on it
(dtype, CPU initialization, recompute), megatron's fusion flags with their reasons, the
decoder's layer spec and final norm (Transformer Engine where megatron runs it, megatron's
local spec with torch SDPA attention otherwise), and the shims a built model needs on CPU.

GPU: Transformer Engine layer spec when installed (fused kernels, flash attention), else
megatron-core's local spec with torch's scaled-dot-product core attention (models/attention.py);
bf16; fusions where they work. CPU: the local spec with the same core attention and a rotary
embedding kept on the CPU (models/megatron_on_cpu.py), float32, fusions off.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import one_line
from ..runtime import bf16_on, precision_overrides, resolve_device, synchronize
from .attention import SDPACoreAttention


def _quiet_cpu_only_notices() -> None:
    """megatron-core's tensor-parallel layers recommend CUDA_DEVICE_MAX_CONNECTIONS=1 on every
    forward, also on CPU (gloo), where there is no CUDA stream it could apply to. On a GPU the
    advice stands (del-train sets the variable itself), so it is silenced only without one.
    Here, where every model is built, rather than on `import del_megatron` (which must not
    wait for torch)."""
    import warnings

    if not torch.cuda.is_available():
        warnings.filterwarnings(
            "ignore", message="When using async grad allreduce", category=UserWarning
        )


_quiet_cpu_only_notices()

FUSION_FLAGS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "gradient_accumulation_fusion",
)


def transformer_engine_available() -> bool:
    """Whether megatron-core itself runs Transformer Engine in this process, read from the
    answers megatron gave when it was imported: its TE extension imported TE's PyTorch part
    (`megatron.core.extensions.transformer_engine.HAVE_TE`), its decoder block did (which
    then builds the final norm as TE's) and its rotary embedding found TE's fused RoPE (which
    TransformerConfig requires for apply_rope_fusion). `import transformer_engine` alone is
    weaker: TE's own `__init__` swallows the ImportError of `transformer_engine.pytorch`
    (a TE built without its PyTorch part, or a torch upgraded under it), so the TE spec and
    the RoPE fusion would be chosen where megatron has neither."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import transformer_block

    return bool(
        te_extension.HAVE_TE
        and transformer_block.HAVE_TE
        and rope_utils.fused_apply_rotary_pos_emb is not None
    )


def recompute_overrides(device: torch.device, enabled: bool) -> dict[str, Any]:
    """Activation recompute: on GPU when enabled (megatron's recompute saves CUDA RNG state,
    so it cannot run on CPU)."""
    if device.type != "cuda" or not enabled:
        return {}
    return {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }


def model_dtype(device: torch.device) -> torch.dtype:
    """Parameters and activations by default (`runtime.bf16_on`): bf16 on GPU, float32 on
    CPU."""
    return precision_overrides(bf16_on(None, device))["params_dtype"]


def transformer_config_overrides(device: torch.device) -> dict[str, Any]:
    """TransformerConfig fields that depend on the device (the precision: its default,
    which a run's train.bf16 overrides in training/build.build_model)."""
    return {
        "use_cpu_initialization": device.type == "cpu",
        **precision_overrides(bf16_on(None, device)),
        **device_fusions(device).flags,
    }


def device_fusions(device: torch.device) -> Fusions:
    """The fusion flags of a model built on `device`, with their reasons (probed on CUDA)."""
    if device.type != "cuda":
        return choose_fusions(device.type, transformer_engine=False, compile_error=None)
    return choose_fusions(
        device.type,
        transformer_engine=transformer_engine_available(),
        compile_error=compile_probe(device.type),
    )


def planned_fusions(requested: str) -> list[str]:
    """--dry-run's account of the fusion flags of train.device=`requested`: chosen here when
    the device is here (CPU, or a CUDA device this process sees: the probe runs), else said
    to be chosen on each GPU node at start."""
    if requested != "cpu" and not torch.cuda.is_available():
        return [
            "chosen on each GPU node at start: "
            + " and ".join(COMPILED_FUSIONS)
            + " where torch.compile runs a tiny fused call, apply_rope_fusion and "
            "masked_softmax_fusion where Transformer Engine is installed"
        ]
    return device_fusions(resolve_device(requested)).lines()


# megatron-core 0.16's fusions of these two go through megatron.core.jit.jit_fuser, which is
# torch.compile: Inductor and Triton at the first step of every process, which need a C
# compiler and Python's headers on every node
COMPILED_FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion")


@dataclass(frozen=True)
class Fusions:
    flags: dict[str, bool]  # every name of FUSION_FLAGS
    reasons: dict[str, str]  # why each is on or off

    def lines(self) -> list[str]:
        return [f"{n} {'on' if self.flags[n] else 'off'}: {self.reasons[n]}" for n in FUSION_FLAGS]


def choose_fusions(
    device_type: str, *, transformer_engine: bool, compile_error: str | None
) -> Fusions:
    """megatron's fusion flags on `device_type`, each with its reason.

    transformer_engine: TE is installed (its fused RoPE; its attention, whose softmax is
    fused). compile_error: None when megatron's compiled fusions ran here (`compile_probe`),
    else why they did not (one line).
    """
    if device_type != "cuda":
        reason = f"{device_type}: megatron's fusions are CUDA kernels or compiled for CUDA"
        return Fusions(dict.fromkeys(FUSION_FLAGS, False), dict.fromkeys(FUSION_FLAGS, reason))
    if compile_error is None:
        compiled = (True, "torch.compile (megatron's jit_fuser) ran a tiny fused call here")
    else:
        compiled = (False, f"torch.compile fails here ({compile_error}); unfused PyTorch ops")
    te = transformer_engine
    chosen = {
        **dict.fromkeys(COMPILED_FUSIONS, compiled),
        "apply_rope_fusion": (te, "Transformer Engine's fused RoPE" if te else "needs TE"),
        "masked_softmax_fusion": (
            te,
            "Transformer Engine's attention" if te else "torch SDPA fuses its own softmax",
        ),
        "persist_layer_norm": (False, "an Apex kernel; RMSNorm is torch's or TE's"),
        "gradient_accumulation_fusion": (
            False,
            "writes megatron's main_grad, which DeepSpeed does not use; the megatron engine "
            "turns it on where megatron found Apex's fused_weight_gradient_mlp_cuda",
        ),
    }
    return Fusions({n: chosen[n][0] for n in FUSION_FLAGS}, {n: chosen[n][1] for n in FUSION_FLAGS})


@functools.cache
def compile_probe(device_type: str) -> str | None:
    """None when megatron's compiled fusions (SwiGLU, bias-dropout-add) run forward and
    backward on a tiny bf16 input on this device, else why not (one line). Once a process;
    in a distributed run the answer is agreed by every rank (one that fails turns them off
    everywhere: the ranks of a tensor-parallel group must compute their replicated
    activations alike)."""
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    error = None
    try:
        x = torch.randn(4, 1, 16, device=device_type, dtype=torch.bfloat16, requires_grad=True)
        y = bias_swiglu_impl(x, None)
        out = bias_dropout_add_fused_train((y, None), torch.zeros_like(y), 0.0)
        out.float().sum().backward()
        synchronize(x.device)
    except Exception as err:  # whatever the compiler raises: the flags go off
        error = one_line(f"{type(err).__name__}: {err}")[:200]
    return _agreed_failure(error)


def _agreed_failure(error: str | None) -> str | None:
    """`error`, or why another rank's probe failed: a host fact agreed as an object (torch
    stages it where the group's backend takes it), so no group, one-process groups included,
    is handed a tensor of the probed device."""
    from .. import collectives

    failed = any(other is not None for other in collectives.all_gather_object(error))
    return error or ("it failed on another rank" if failed else None)


def gpt_decoder_spec(device: torch.device, num_layers: int, *, qk_layernorm: bool = False):
    """The decoder's modules on this device, every one named here: `num_layers` layers of
    `gpt_layer_spec` (this pipeline stage's count: megatron builds every spec it is given,
    numbered from the stage's offset) and the final norm of `final_norm`. A layer spec alone
    would leave the final norm to megatron's own import-time choice
    (transformer_block.LayerNormImpl: TE's, else Apex's, else torch's, whatever the device):
    Apex's FusedLayerNorm refuses RMSNorm,
    and TE's on CPU parameters fails its first forward."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = gpt_layer_spec(device, qk_layernorm=qk_layernorm)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=final_norm(device)
    )


def uses_transformer_engine(device: torch.device) -> bool:
    """Transformer Engine's modules for a model on `device`: CUDA, where megatron runs TE."""
    return device.type == "cuda" and transformer_engine_available()


def final_norm(device: torch.device) -> type:
    """The decoder's final RMSNorm on this device: TE's with the TE spec, torch's otherwise."""
    if uses_transformer_engine(device):
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def gpt_layer_spec(device: torch.device, *, qk_layernorm: bool = False):
    """The megatron-core layer spec for a Llama-family decoder layer on this device: every
    submodule (norms, linear layers, core attention) named by the spec, none left to
    megatron's import-time choice."""
    from megatron.core.models.gpt import gpt_layer_specs

    if uses_transformer_engine(device):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        normalization="RMSNorm", qk_layernorm=qk_layernorm
    )
    # megatron's local DotProductAttention materialises the scores [b, heads/tp, s, s] and
    # fp32 softmax copies (several GiB a layer at 7B widths, s=4096) and allocates them on
    # torch.cuda.current_device() (so it cannot run on CPU): torch's SDPA instead, on CUDA
    # its flash / memory-efficient / cuDNN kernels (no [s, s] tensor, as the memory plan
    # assumes), on CPU its fused CPU kernel
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def apply_device_shims(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Shims a built model needs on this device (none on GPU; models/megatron_on_cpu.py on
    CPU). Idempotent."""
    if device.type == "cpu":
        from .megatron_on_cpu import keep_rotary_on_cpu

        keep_rotary_on_cpu(model)
    return model
