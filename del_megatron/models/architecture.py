"""The architecture record of a Llama-family decoder (Llama/CodeLlama, Mistral, Qwen-2.5,
DeepSeek): a pure pydantic schema, importable without megatron-core (the run config,
config.json mapping and memory plan read it; models/llama.py builds the megatron model)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
