"""Causal core attention on torch's scaled_dot_product_attention: the core attention of every
model built without Transformer Engine (CPU, and CUDA without TE; models/spec.gpt_layer_spec)."""

from __future__ import annotations

import contextlib
import math

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

# scaled_dot_product_attention serves grouped-query attention itself from torch 2.5
# (`enable_gqa`: no [s, b, heads/tp, d] copies of each key and value head); pyproject admits 2.4
GQA_IN_SDPA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


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
        grouped = {}
        if repeat > 1 and GQA_IN_SDPA:  # each k/v head serves `repeat` query heads, in SDPA
            grouped["enable_gqa"] = True
        elif repeat > 1:  # torch < 2.5: copies of each k/v head
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        dropout = self.dropout if self.training else 0.0
        # dropout of this rank's heads draws from the tensor-parallel generator (as megatron's
        # own attention does); megatron's tracker exists on CUDA only
        fork = _tensor_parallel_rng if dropout and query.is_cuda else contextlib.nullcontext
        with fork():
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout, **grouped
            )
        sq, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * self.head_dim)


def _tensor_parallel_rng():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().fork()


def _tp_world_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()
