"""The core attention of every run without Transformer Engine (`SDPACoreAttention`, torch's
SDPA) equals megatron-core's local `DotProductAttention`, values and gradients.

Megatron's attention is run itself, on the CPU: its two CUDA allocations (the global memory
buffer of the scores, the default causal mask) are answered on the CPU (`cuda_on_cpu`); its
math (baddbmm of the scaled scores, masked softmax, bmm) is its own. Sizes are odd, k/v
groups serve several query heads, and a tensor-parallel rank's slice of the heads (TP 2) is
checked through the process-group collection both modules take.

Before, CUDA without Transformer Engine ran megatron's local attention, which materialises
the scores [b, heads/tp, s, s] plus fp32 softmax copies (several GiB a layer at 7B widths):
`test_cuda_without_transformer_engine_uses_sdpa` failed on the old code (the spec's core
attention was megatron's DotProductAttention).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from del_megatron.models.architecture import LlamaArchitecture

pytestmark = pytest.mark.megatron  # run on every supported megatron-core

# heads, query groups, tensor parallel, sequence, batch, head dim
CASES = [
    (4, 4, 1, 7, 2, 8),  # multi-head
    (6, 2, 1, 13, 3, 16),  # grouped-query: 3 query heads a group, odd length
    (8, 2, 2, 9, 2, 12),  # one TP-2 rank's slice: 4 heads, 1 group
    (12, 4, 2, 11, 1, 20),  # TP 2: 6 heads, 2 groups
    (2, 1, 1, 1, 2, 8),  # one token
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # absolute, on values of unit scale


def attention_pair(heads, groups, tp, head_dim, dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from del_megatron.models.attention import SDPACoreAttention
    from del_megatron.models.llama import transformer_config
    from del_megatron.runtime import seed_rngs

    seed_rngs(0, cuda_tracker=True)  # megatron's attention forks the tracker around dropout
    arch = LlamaArchitecture(
        vocab_size=64,
        hidden_size=heads * head_dim,
        ffn_hidden_size=16,
        num_layers=1,
        num_attention_heads=heads,
        num_query_groups=groups,
        max_position_embeddings=32,
    )
    bf16 = dtype == torch.bfloat16
    config = transformer_config(arch, torch.device("cpu"), bf16=bf16, params_dtype=dtype)
    ranks = SimpleNamespace(tp=SimpleNamespace(size=lambda: tp))
    return [
        cls(
            config,
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            pg_collection=ranks,
        )
        for cls in (DotProductAttention, SDPACoreAttention)
    ]


def forward_backward(module, q, k, v, upstream):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, attention_mask=None)
    out.backward(upstream)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "groups", "tp", "s", "b", "d"), CASES)
def test_sdpa_equals_megatron_local_attention(
    cuda_on_cpu, one_process_groups, heads, groups, tp, s, b, d, dtype
):
    megatron, sdpa = attention_pair(heads, groups, tp, d, dtype)
    gen = torch.Generator().manual_seed(heads * 100 + s)
    q = torch.randn(s, b, heads // tp, d, generator=gen).to(dtype)
    k = torch.randn(s, b, groups // tp, d, generator=gen).to(dtype)
    v = torch.randn(s, b, groups // tp, d, generator=gen).to(dtype)
    upstream = torch.randn(s, b, heads // tp * d, generator=gen).to(dtype)
    expected = forward_backward(megatron, q, k, v, upstream)
    got = forward_backward(sdpa, q, k, v, upstream)
    for name, a, e in zip(("output", "dq", "dk", "dv"), got, expected, strict=True):
        assert a.shape == e.shape, name
        torch.testing.assert_close(
            a.float(), e.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype], msg=name
        )


def test_cuda_without_transformer_engine_uses_sdpa(monkeypatch):
    from del_megatron.models import spec as device

    monkeypatch.setattr(device, "transformer_engine_available", lambda: False)
    for where in ("cuda", "cpu"):
        spec = device.gpt_layer_spec(torch.device(where))
        assert spec.submodules.self_attention.submodules.core_attention is device.SDPACoreAttention
