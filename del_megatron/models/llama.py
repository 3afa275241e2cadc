"""Llama-family architectures (Llama/CodeLlama, Mistral, Qwen-2.5, DeepSeek) as megatron-core
GPTModels: RMSNorm, SwiGLU, RoPE (optionally Llama-3.1-scaled), grouped-query attention,
tied or untied embeddings, optional QKV bias, vocabulary padded for tensor parallelism."""

from __future__ import annotations

from typing import Any

import torch

from ..losses import DigitVocab, NumericLossConfig
from ..runtime import seed_rngs
from .architecture import LlamaArchitecture
from .gpt import NumericLossGPTModel
from .spec import apply_device_shims, gpt_decoder_spec, transformer_config_overrides


def transformer_config(arch: LlamaArchitecture, device: torch.device, **overrides: Any):
    """megatron-core TransformerConfig of `arch` on `device`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.kv_channels,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.norm_epsilon,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": _tp_size(),
        **_pipeline_sizes(),
        "cuda_graph_scope": [],  # no CUDA graphs; megatron's default "full" is deprecated
        **transformer_config_overrides(device),
    }
    fields.update(overrides)
    if fields["pipeline_model_parallel_size"] > 1:
        fields.setdefault("pipeline_dtype", fields["params_dtype"])  # what stages exchange
    return TransformerConfig(**fields)


def model_config(
    arch: LlamaArchitecture,
    device: torch.device,
    *,
    seed: int,
    weights_follow: bool,
    **overrides: Any,
):
    """The TransformerConfig every megatron layer of ours is built with (the trainer, del-eval's
    checkpoint backend, the benches), after seeding the generators its build and forward draw
    from (`device.seed_rngs`: megatron's CUDA RNG tracker whenever the config builds for CUDA).

    weights_follow: the caller loads every parameter right after the build, so megatron's
    random initialization is skipped (`perform_initialization=False`: nothing drawn, the
    parameters left uninitialized until the load).
    """
    config = transformer_config(
        arch, device, **{"perform_initialization": not weights_follow, **overrides}
    )
    seed_rngs(seed, cuda_tracker=not config.use_cpu_initialization)
    return config


def build_llama(
    arch: LlamaArchitecture,
    digit_vocab: DigitVocab,
    loss_config: NumericLossConfig,
    device: torch.device,
    *,
    seed: int,
    weights_follow: bool = False,
    promise_scaled_loss: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    **config_overrides: Any,
) -> NumericLossGPTModel:
    """A megatron-core GPTModel of `arch` whose loss is the numeric loss hook, built from
    `model_config` (seeded; no random init when `weights_follow`).

    Needs megatron's parallel state initialized (tensor parallel size taken from it).
    promise_scaled_loss: the caller's backward is of `loss_func`'s loss sum times one factor
    (the trainer's is): see `NumericLossGPTModel`. pre_process, post_process, vp_stage: the
    pipeline stage (megatron's meaning: the embedding, the output layer and loss, the
    virtual stage), with the pipeline's sizes among `config_overrides`.
    """
    tp = _tp_size()
    arch.check_tensor_parallel(tp)
    config = model_config(
        arch, device, seed=seed, weights_follow=weights_follow, **config_overrides
    )
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    # this stage's layers only (megatron numbers them from the stage's offset)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    model = NumericLossGPTModel(
        config=config,
        transformer_layer_spec=gpt_decoder_spec(device, layers),
        vocab_size=arch.padded_vocab_size(tp),
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # a float: int() would change a fractional theta
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        digit_vocab=digit_vocab,
        loss_config=loss_config,
        promise_scaled_loss=promise_scaled_loss,
    )
    if weights_follow:
        mark_tensor_parallel(model)
    model = apply_device_shims(model, device)
    if any(p.is_meta for p in model.parameters()):
        return model  # built under torch.device("meta"): shapes without memory, for checks
    return model.to(device)


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """The tensor-parallel attributes (`tensor_model_parallel`, `partition_dim`,
    `partition_stride`) on every partitioned parameter that lacks them. megatron's local
    layers set them inside their random initialization (`_initialize_affine_weight_cpu`,
    `_gpu`), which `perform_initialization=False` skips: without them DeepSpeed's and
    megatron's gradient norms count a partitioned gradient as a copy of tensor-parallel
    rank 0's (only rank 0's shard enters the norm, and the clip follows the wrong norm),
    and a gather of the full weights takes one shard for the whole."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from .hf_tensors import canonical
    from .sharding import partition_of

    for name, param in model.named_parameters():
        partition = partition_of(canonical(name))
        if partition is not None and not getattr(param, "tensor_model_parallel", False):
            dim, stride = partition
            for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(param, attribute):  # megatron asserts none is set before
                    delattr(param, attribute)
            set_tensor_model_parallel_attributes(param, True, dim, stride)


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _pipeline_sizes() -> dict[str, int | None]:
    """The pipeline's (and its virtual stages') sizes of megatron's parallel state."""
    from megatron.core import parallel_state

    return {
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": (
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
    }
