"""Every device-dependent choice of the model, in one place.

GPU: Transformer Engine layer spec when installed (fused kernels, flash attention), bf16,
fusions on. CPU: megatron-core's local spec with a scaled-dot-product core attention and a
rotary embedding kept on the CPU, float32, fusions off. The CPU shims are applied only when
the device is the CPU.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


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
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_device(requested: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; a named device must exist."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    return device


def select_accelerator(device: torch.device) -> None:
    """Tell DeepSpeed which accelerator to use; call before deepspeed is imported and before
    the first CUDA context."""
    import os

    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # megatron-core's asynchronous all-reduce of input gradients across tensor-parallel ranks
    # relies on kernels starting in launch order, which one hardware queue per device gives
    # (Megatron-LM and NeMo set the same; megatron warns without it). No effect on CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


@contextlib.contextmanager
def quiet_communication_setup(device: torch.device):
    """On CPU, DeepSpeed loads its shared-memory all-reduce op and prints that it 'built
    successfully' on every rank: nothing a user can act on. Its stdout is dropped there."""
    if device.type != "cpu":
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def process_group_backend(device: torch.device) -> str:
    """NCCL on GPU, gloo on CPU: the backend every group of the run inherits."""
    return "nccl" if device.type == "cuda" else "gloo"


def bind_local_device(device: torch.device, local_rank: int) -> None:
    """Each rank of a node on its own GPU. A cluster that binds GPUs to tasks (srun
    --gpus-per-task, --gpu-bind) shows each rank fewer devices than ranks per node; the
    local rank modulo the visible devices is right in both cases."""
    if device.type == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def batch_to_device(
    batch: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """A loader's host batch on the compute device. CUDA: copied into page-locked memory,
    then an asynchronous transfer (`non_blocking`), so the host goes on queueing the step
    instead of waiting for the GPU to drain; CPU: the tensors as they are."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: around a timing, so it measures the work and not
    only its launch. Nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# bf16 dense peak FLOP/s per device, for MFU (the vendors' figures for SXM parts)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """This device's bf16 dense peak, None where unknown (no MFU is reported then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


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
    """Parameters and activations: bf16 on GPU, float32 on CPU."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def transformer_config_overrides(device: torch.device) -> dict[str, Any]:
    """TransformerConfig fields that depend on the device."""
    if device.type == "cpu":
        return {
            "use_cpu_initialization": True,
            "params_dtype": model_dtype(device),
            "bf16": False,
            **dict.fromkeys(FUSION_FLAGS, False),
        }
    return {
        "use_cpu_initialization": False,
        "params_dtype": model_dtype(device),
        "bf16": True,
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
        # megatron's fused softmax kernels come with Transformer Engine / Apex builds
        "masked_softmax_fusion": transformer_engine_available(),
        "apply_rope_fusion": transformer_engine_available(),
        "gradient_accumulation_fusion": False,
    }


def gpt_layer_spec(device: torch.device, *, qk_layernorm: bool = False):
    """The megatron-core layer spec for a Llama-family decoder layer on this device."""
    from megatron.core.models.gpt import gpt_layer_specs

    if device.type == "cuda" and transformer_engine_available():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        normalization="RMSNorm", qk_layernorm=qk_layernorm
    )
    if device.type == "cpu":
        # The stock local attention allocates a buffer on torch.cuda.current_device().
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def apply_device_shims(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Shims a built model needs on this device (none on GPU). Idempotent."""
    if device.type == "cpu":
        for module in model.modules():
            if type(module) is RotaryEmbedding:
                module.__class__ = CPURotaryEmbedding
    return model


class CPURotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose frequencies stay on the CPU (the stock one moves them to CUDA)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1)
            emb = emb.view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [s, 1, 1, dim]


class SDPACoreAttention(MegatronModule):
    """Causal core attention on torch's scaled_dot_product_attention (CPU path).

    query [sq, b, heads/tp, d], key/value [sk, b, groups/tp, d] -> [sq, b, heads/tp * d].
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        tp = pg_collection.tp.size() if pg_collection is not None else _tp_world_size()
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention supports plain causal attention only")
        repeat = self.heads_per_partition // self.groups_per_partition
        if repeat > 1:  # grouped-query attention: each k/v head serves `repeat` query heads
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        context = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
        )
        sq, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * self.head_dim)


def _tp_world_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()
