"""Llama-family architectures (Llama/CodeLlama, Mistral, Qwen-2.5, DeepSeek) as megatron-core
GPTModels: RMSNorm, SwiGLU, RoPE (optionally Llama-3.1-scaled), grouped-query attention,
tied or untied embeddings, optional QKV bias, vocabulary padded for tensor parallelism."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..losses import DigitVocab, NumericLossConfig
from .device import apply_device_shims, gpt_layer_spec, transformer_config_overrides
from .gpt import NumericLossGPTModel

Family = Literal["llama", "mistral", "qwen2"]


class LlamaArchitecture(BaseModel):
    """Shape of a Llama-family decoder: every field that changes the computation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: Family = "llama"
    """Hugging Face model_type the weights come from and are exported as (llama covers
    Llama-2, CodeLlama and DeepSeek's Llama architecture; mistral adds a sliding window;
    qwen2 a QKV bias)."""
    vocab_size: int = Field(gt=0)
    """Tokens of the tokenizer (before padding)."""
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int = Field(gt=0)
    """Key/value heads (grouped-query attention); = num_attention_heads for plain MHA."""
    head_dim: int | None = Field(default=None, gt=0)
    """Channels per attention head; unset: hidden_size / num_attention_heads."""
    max_position_embeddings: int = Field(gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling_factor: float | None = Field(default=None, gt=0)
    """Llama-3.1-style RoPE frequency scaling with this factor (low/high frequency factors
    1 and 4, original context 8192: the only variant megatron-core implements); unset: none."""
    sliding_window: int | None = Field(default=None, gt=0)
    """Attention window of the original model (Mistral). Training needs train.seq_len within
    it, where the window never binds; unset: full attention."""
    norm_epsilon: float = Field(default=1e-5, gt=0)
    qkv_bias: bool = False
    """Bias on the query/key/value projection (Qwen-2)."""
    tie_word_embeddings: bool = False
    """One matrix for the input embedding and the output layer (Qwen2.5-1.5B)."""
    make_vocab_size_divisible_by: int = Field(default=128, gt=0)
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""

    @model_validator(mode="after")
    def _check(self) -> LlamaArchitecture:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads} (set head_dim)"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {self.num_query_groups}"
            )
        return self

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        for field in ("num_attention_heads", "num_query_groups"):
            if getattr(self, field) % tensor_parallel:
                raise ValueError(
                    f"{field}={getattr(self, field)} is not divisible by tensor parallel size "
                    f"{tensor_parallel}"
                )


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
        "cuda_graph_scope": [],  # no CUDA graphs; megatron's default "full" is deprecated
        **transformer_config_overrides(device),
    }
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_llama(
    arch: LlamaArchitecture,
    digit_vocab: DigitVocab,
    loss_config: NumericLossConfig,
    device: torch.device,
    **config_overrides: Any,
) -> NumericLossGPTModel:
    """A megatron-core GPTModel of `arch` whose loss is the numeric loss hook.

    Needs megatron's parallel state initialized (tensor parallel size taken from it).
    """
    tp = _tp_size()
    arch.check_tensor_parallel(tp)
    config = transformer_config(arch, device, **config_overrides)
    model = NumericLossGPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(device),
        vocab_size=arch.padded_vocab_size(tp),
        max_sequence_length=arch.max_position_embeddings,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # a float: int() would change a fractional theta
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        digit_vocab=digit_vocab,
        loss_config=loss_config,
    )
    model = apply_device_shims(model, device)
    if any(p.is_meta for p in model.parameters()):
        return model  # built under torch.device("meta"): shapes without memory, for checks
    return model.to(device)


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()
