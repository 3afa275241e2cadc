"""A run's memory plan per GPU, before anything is allocated: the terms every engine's plan
is made of (parameters, each rank's tensors, activations at the configured micro-batch,
sequence and recompute, the logits of the loss, the reserve, the device), and `plan_run`,
which asks the run's engine for its plan (`EngineKind.memory_plan`): the model states as
each engine allocates them are the engine's (DeepSpeed's ZeRO stages:
engines/deepspeed.model_state_bytes, counted from DeepSpeed's engine by
tests/distributed/test_zero_memory.py; megatron's stages: engines/megatron.py).

Activations are an estimate for megatron-core's Llama layer in bf16 without sequence
parallelism and with flash attention (no [s, s] score matrix kept: Transformer Engine's
attention, or without it torch SDPA's fused kernels, models/attention.SDPACoreAttention): per
layer the layer-norm inputs and outputs, q/k/v, the attention output, SwiGLU's two fc1
outputs and the activation, i.e. 2 bytes x s x b x (4h + (q + 2kv + q + 3f) / tp). With full
recompute a layer keeps only its input (2 s b h) and one layer's activations exist at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.architecture import LlamaArchitecture

GIB = 1 << 30
RESERVE = 3 * GIB  # CUDA context, NCCL buffers, allocator slack: a round estimate
ASSUMED_GPU_GIB = 80  # when no GPU is visible (a login node): an 80 GB H100 / A100


@dataclass(frozen=True)
class ParameterCount:
    total: int  # the model as built (padded vocabulary)
    unpadded: int  # without the vocabulary padding: the published figure
    per_rank: int  # on one tensor-parallel rank
    largest_layer: int  # the largest single module on one rank (ZeRO-3 gathers it whole)


def count_parameters(arch: LlamaArchitecture, tp: int) -> ParameterCount:
    h, d, f = arch.hidden_size, arch.kv_channels, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    padded = arch.padded_vocab_size(tp)
    embeddings = 1 if arch.tie_word_embeddings else 2
    attention = (q + 2 * kv) * h + (q + 2 * kv if arch.qkv_bias else 0) + h * q
    mlp = 3 * f * h
    split = arch.num_layers * (attention + mlp) + embeddings * padded * h
    replicated = arch.num_layers * 2 * h + h  # norms
    return ParameterCount(
        total=split + replicated,
        unpadded=split + replicated - embeddings * (padded - arch.vocab_size) * h,
        per_rank=split // tp + replicated,
        largest_layer=max(padded * h, 2 * f * h, (q + 2 * kv) * h) // tp,
    )


def flops_per_token(arch: LlamaArchitecture, tp: int, seq_len: int) -> int:
    """Training FLOPs a token costs (forward and backward), as Megatron-LM counts them
    (megatron/training/training.py, `num_floating_point_operations`, dense GPT, every
    sequence of length `seq_len`): 3 passes (forward, input and weight gradients) x 2 FLOPs a
    multiply-add, over each matmul's weights: per layer q/k/v and the output projection
    (h x (q + 2 kv) + q x h) and SwiGLU's three (3 x h x ffn), and the logits once (h x the
    padded vocabulary, tied or not: the input embedding is a lookup, no matmul); plus the
    core attention, QK^T and softmax x V over the causal half of the sequence: 6 x q x s a
    layer. Norms and biases are not counted. From the architecture, not from the built
    model's tensors: ZeRO 3 leaves those empty after `deepspeed.initialize`, and a
    tensor-parallel rank holds a share of them."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * arch.kv_channels, arch.num_query_groups * arch.kv_channels
    layer = h * (q + 2 * kv) + q * h + 3 * h * f
    matmul_weights = arch.num_layers * layer + h * arch.padded_vocab_size(tp)
    core_attention = arch.num_layers * q * seq_len
    return 6 * matmul_weights + 6 * core_attention


def rank_tensors(
    arch: LlamaArchitecture, tp: int, stage: tuple[int, bool, bool] | None = None
) -> list[int]:
    """The element count of every parameter tensor one tensor-parallel rank holds, as built
    (padded vocabulary; norms and biases whole on every rank). stage: (layers, first, last)
    of a pipeline stage (None: the whole model): the embedding on the first, the final norm
    and the output layer on the last, a tied embedding's copy there too when the two are
    different stages (megatron keeps both and all-reduces their gradients)."""
    h, d, f = arch.hidden_size, arch.kv_channels, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    vocab = arch.padded_vocab_size(tp) // tp * h
    layer = [h, (q + 2 * kv) * h // tp, h * q // tp, h, 2 * f * h // tp, f * h // tp]
    if arch.qkv_bias:
        layer.append((q + 2 * kv) // tp)
    layers, first, last = stage or (arch.num_layers, True, True)
    embeddings = [vocab] * (first + last)
    if first and last and arch.tie_word_embeddings:
        embeddings = [vocab]
    return embeddings + layer * layers + ([h] if last else [])


def activation_bytes(
    arch: LlamaArchitecture,
    tp: int,
    micro_batch: int,
    seq_len: int,
    recompute: bool,
    dtype_bytes: int,
    layers: int | None = None,
) -> int:
    """The activations `layers` (default: every layer) keep for backward, one micro-batch."""
    h, d, f = arch.hidden_size, arch.kv_channels, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    tokens = micro_batch * seq_len
    layers = arch.num_layers if layers is None else layers
    layer = dtype_bytes * tokens * (4 * h + (2 * q + 2 * kv + 3 * f) // tp)
    if recompute:
        return layers * dtype_bytes * tokens * h + layer
    return layers * layer


def logits_bytes(
    arch: LlamaArchitecture, tp: int, micro_batch: int, seq_len: int, dtype_bytes: int
) -> int:
    """Logits [s, b, V/tp] in the model's dtype, the loss's float32 buffer, and their
    gradient: the largest single activation with a big vocabulary."""
    elements = micro_batch * seq_len * arch.padded_vocab_size(tp) // tp
    return elements * (2 * dtype_bytes + 4)


@dataclass(frozen=True)
class Plan:
    parameters: ParameterCount
    per_gpu: dict[str, int]  # bytes by part, "total" included
    device_bytes: int
    device_label: str
    stage: int | None = None  # the pipeline stage planned: the one that needs the most

    @property
    def fits(self) -> bool:
        return self.per_gpu["total"] <= self.device_bytes

    def advice(self, zero_stage: int, recompute: bool) -> str:
        """The knob that shrinks the largest part."""
        parts = {k: v for k, v in self.per_gpu.items() if k not in ("total", "reserve")}
        largest = max(parts, key=parts.get)
        if largest in ("weights", "gradients", "optimizer", "buffers"):
            if self.stage is not None:
                return "raise parallel.pipeline_parallel or parallel.tensor_parallel"
            if zero_stage < 3:
                return f"raise parallel.zero_stage (now {zero_stage}) or parallel.tensor_parallel"
            return "raise parallel.tensor_parallel or use more GPUs (data parallel)"
        if largest == "activations" and not recompute:
            return "set train.activation_checkpointing: true"
        return "lower train.micro_batch_size (raise gradient accumulation instead)"

    def lines(self, zero_stage: int, recompute: bool) -> list[str]:
        p = self.parameters
        out = [
            f"parameters: {p.unpadded:,} ({p.total:,} with vocabulary padding), "
            f"{p.per_rank:,} per tensor-parallel rank",
            ("per GPU: " if self.stage is None else f"per GPU (stage {self.stage}, the largest): ")
            + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in self.per_gpu.items() if k != "total"),
            f"per GPU total: {self.per_gpu['total'] / GIB:.1f} GiB of {self.device_bytes / GIB:.0f}"
            f" GiB ({self.device_label})",
        ]
        if not self.fits:
            out.append(
                f"warning: this will not fit in GPU memory; {self.advice(zero_stage, recompute)}"
            )
        return out


def device_memory(assumed_gib: float | None = None) -> tuple[int, str]:
    import torch

    if assumed_gib is None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, props.name
    gib = assumed_gib or ASSUMED_GPU_GIB
    return int(gib * GIB), f"assumed {gib:g} GiB GPU" if assumed_gib else "assumed 80 GiB GPU"


def plan_run(cfg, world_size: int, *, gpu_memory_gib: float | None = None) -> Plan:
    """The plan of `cfg` at `world_size` ranks, on GPUs (bf16) whatever train.device says:
    the question it answers is whether the run fits there. Each engine plans its own ranks
    (`EngineKind.memory_plan`, from the terms above)."""
    from .engines import kind_of

    return kind_of(cfg.train.engine).memory_plan(cfg, world_size, gpu_memory_gib)
