"""Every device-dependent choice of the model, in one place.

GPU: Transformer Engine layer spec when installed (fused kernels, flash attention), else
megatron-core's local spec with torch's scaled-dot-product core attention; bf16; fusions
where they work. CPU: the local spec with the same core attention and a rotary embedding
kept on the CPU, float32, fusions off. The CPU shims are applied only when the device is
the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from ..errors import UserError, one_line


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


def deterministic_algorithms(enabled: bool) -> None:
    """train.deterministic: torch's deterministic kernels only, an error where an op has
    none (torch.use_deterministic_algorithms; embedding and attention backwards, scatters and
    index adds take their ordered forms), and cuBLAS's workspace fixed before its first use
    (CUBLAS_WORKSPACE_CONFIG, which it reads then): what two runs need to repeat bit for
    bit. Call before the first CUDA kernel."""
    import os

    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


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


def local_device_index(env: Mapping[str, str], device_count: int) -> int:
    """The CUDA device (an index among those this process sees) of this rank.

    env: the process environment (LOCAL_RANK, or SLURM_LOCALID under srun; LOCAL_WORLD_SIZE
    when torchrun started it); device_count: the devices this process sees (after
    CUDA_VISIBLE_DEVICES). Every rank of a node that sees the node's devices (torchrun, srun
    without GPU binding) takes its local rank; a task bound to one GPU (srun
    --gpus-per-task=1, --gpu-bind) sees that GPU alone, as device 0, whatever its local rank.
    Anything else would put two ranks on one device (NCCL refuses it) or leave the choice to
    chance: one line naming what was seen.
    """
    local = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")))
    if device_count < 1:
        raise UserError("train.device=cuda but this process sees no CUDA device")
    if local < device_count:
        return local
    if device_count == 1 and "LOCAL_WORLD_SIZE" not in env:  # srun's per-task binding
        return 0
    visible = env.get("CUDA_VISIBLE_DEVICES", "unset")
    raise UserError(
        f"local rank {local} but this process sees {device_count} CUDA device(s) "
        f"(CUDA_VISIBLE_DEVICES={visible}): start one rank per GPU (torchrun --nproc_per_node "
        "at most the GPUs, or srun --gpus-per-task=1)"
    )


def bind_local_device(device: torch.device, env: MutableMapping[str, str]) -> None:
    """Each rank of a node on its own GPU (`local_device_index`), before the process group
    exists. DeepSpeed binds `cuda:LOCAL_RANK` itself (deepspeed/comm/torch.py device_id,
    engine `_set_distributed_vars`, ZeRO 3's `Init`): LOCAL_RANK is set to the same index
    (it differs from the launcher's only under srun, whose SLURM_LOCALID stays)."""
    if device.type != "cuda":
        return
    index = local_device_index(env, torch.cuda.device_count())
    env["LOCAL_RANK"] = str(index)
    torch.cuda.set_device(index)


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


# bf16 dense (no sparsity) peak FLOP/s, for MFU, by the exact name CUDA gives the device
# (torch.cuda.get_device_name): NVIDIA's datasheets. One chip sold in several forms differs
# in clocks and power: an H100 PCIe peaks at 756, an H100 NVL at 835, the SXM part at 989.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA L40S": 362e12,
}


def peak_flops(device: torch.device) -> float | None:
    """This device's bf16 dense peak, None for a name not in PEAK_FLOPS (no MFU is reported
    then, rather than another part's peak)."""
    if device.type != "cuda":
        return None
    return PEAK_FLOPS.get(torch.cuda.get_device_name(device))


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


@dataclass(frozen=True)
class MegatronEngineChoices:
    """What megatron-core's engine (train.engine=megatron) runs on a device."""

    distributed_optimizer: bool  # sharded fp32 masters and moments (CUDA tensors only)
    overlap: bool  # gradient reduction and parameter all-gather behind compute (buckets)
    bf16: bool  # bf16 parameters with fp32 masters


def megatron_engine_choices(device: torch.device) -> MegatronEngineChoices:
    """GPU: megatron's distributed optimizer (it refuses CPU tensors: "Wrapped parameters
    must be one of torch.cuda.FloatTensor ..."), overlapped reductions, bf16; CPU: megatron's
    FP32 optimizer, reductions after backward, float32."""
    gpu = device.type == "cuda"
    return MegatronEngineChoices(distributed_optimizer=gpu, overlap=gpu, bf16=gpu)


def megatron_engine_on(device: torch.device) -> None:
    """Ready megatron-core's schedules, DDP and optimizer for a run on `device`: on CPU their
    hard-coded CUDA allocations are moved to the CPU (models/megatron_on_cpu.py, a process-
    wide rebinding in megatron's modules); nothing on GPU."""
    if device.type == "cpu":
        from . import megatron_on_cpu

        megatron_on_cpu.rebind()


def building_stages(device: torch.device):
    """Around building pipeline stages on `device`: on CPU, megatron's `tensor.cuda()` of a
    tied embedding's copy on the last stage keeps the tensor where it is; nothing on GPU."""
    if device.type == "cpu":
        from . import megatron_on_cpu

        return megatron_on_cpu.tensor_cuda_stays()
    return contextlib.nullcontext()


def pipeline_overrides(device: torch.device, pipeline_parallel: int) -> dict[str, Any]:
    """TransformerConfig fields of the pipeline's point-to-point traffic: gloo (CPU)
    reorders batched sends and receives, so they go one by one there."""
    if pipeline_parallel > 1 and device.type == "cpu":
        return {"batch_p2p_comm": False}
    return {}


def seed_rngs(seed: int, *, cuda_tracker: bool) -> None:
    """torch's generators (every device) and, with `cuda_tracker`, megatron's tensor-parallel
    CUDA RNG tracker. A model built for CUDA (`use_cpu_initialization=False`) draws from the
    tracker: megatron's weight init (`_initialize_affine_weight_gpu`), dropout inside
    tensor-parallel regions and activation recompute fork it, and an unseeded tracker raises
    "cuda rng state model-parallel-rng is not added". Every build seeds it first
    (models/llama.model_config)."""
    torch.manual_seed(seed)
    if cuda_tracker:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def model_dtype(device: torch.device) -> torch.dtype:
    """Parameters and activations: bf16 on GPU, float32 on CPU."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def transformer_config_overrides(device: torch.device) -> dict[str, Any]:
    """TransformerConfig fields that depend on the device."""
    cpu = device.type == "cpu"
    return {
        "use_cpu_initialization": cpu,
        "params_dtype": model_dtype(device),
        "bf16": not cpu,
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
            "writes megatron's main_grad, which DeepSpeed does not use",
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
    """Causal core attention on torch's scaled_dot_product_attention: the core attention of
    every run without Transformer Engine (CPU, and CUDA without TE). The math of megatron's
    local DotProductAttention (softmax(q k^T * scale, causal) v, each k/v group serving
    heads/groups query heads), tested equal in values and gradients.

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
        dropout = self.dropout if self.training else 0.0
        # dropout of this rank's heads draws from the tensor-parallel generator (as megatron's
        # own attention does); megatron's tracker exists on CUDA only
        fork = _tensor_parallel_rng if dropout and query.is_cuda else contextlib.nullcontext
        with fork():
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout
            )
        sq, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * self.head_dim)


def _tensor_parallel_rng():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().fork()


def _tp_world_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()
