"""The loss head: its options reach the op it chooses (fused or not, chunk size, recompute),
its EMO cost embedding is a persistent buffer taken from the weights it is given, and both
its ways give the same loss. One process, a world of one rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding
from del_megatron.config import load_run_config
from del_megatron.losses import NumericLossHead, default_chunk_tokens
from tests.utils import assert_close

ROOT = Path(__file__).resolve().parents[2]

aten = torch.ops.aten
VOCAB, HIDDEN, SEQ, BATCH = 256, 8, 12, 2


class Products(TorchDispatchMode):
    """How many matrix products run while active."""

    def __enter__(self):
        self.count = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten.mm, aten.addmm, aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def batch(dtype=torch.float64):
    gen = torch.Generator().manual_seed(3)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=VOCAB)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[:, ::2] = torch.randint(10, 20, (BATCH, SEQ // 2), generator=gen)
    mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.2).float()
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=dtype, requires_grad=True)
    return vocab, labels, mask, hidden, weight


@pytest.mark.parametrize("recompute", [False, True])
def test_config_reaches_the_fused_op(group, recompute):
    """loss.fused_recompute and loss.fused_chunk_tokens, read from a run config, decide what
    the op does: one product per chunk in forward when it recomputes (logits only), three
    when it forms the gradient there; the chunk count follows the chunk size."""
    overrides = ["loss.fused_output=true", "loss.fused_chunk_tokens=5"]
    overrides.append(f"loss.fused_recompute={str(recompute).lower()}")
    run = load_run_config(ROOT / "configs" / "tiny_cpu.yaml", overrides)
    vocab, labels, mask, hidden, weight = batch()
    head = NumericLossHead(vocab, run.loss)
    chunks = -(-SEQ * BATCH // 5)
    with Products() as forward:
        out = head(labels, mask, group, hidden=hidden, output_weight=weight)
    with Products() as backward:
        out.loss.backward()
    assert forward.count == (1 if recompute else 3) * chunks
    assert backward.count == (3 * chunks if recompute else 0)


def test_recompute_without_the_fused_path_is_refused():
    with pytest.raises(ValueError, match="fused_recompute=True applies to the fused path only"):
        NumericLossConfig(fused_recompute=True)


def test_one_default_chunk_per_device():
    head = NumericLossHead(DigitVocab(digit_ids=list(range(10))), NumericLossConfig())
    assert head.chunk_tokens(torch.device("cpu")) == default_chunk_tokens(torch.device("cpu"))
    assert default_chunk_tokens(torch.device("cuda")) == 1024  # a device object, no GPU used
    sized = NumericLossConfig(fused_output=True, fused_chunk_tokens=48)
    assert NumericLossHead(head.vocab, sized).chunk_tokens(torch.device("cpu")) == 48


@pytest.mark.parametrize("kind", ["del", "mixce", "emo"])
def test_fused_and_unfused_heads_agree(group, kind):
    """Values, statistics and both gradients, float64."""
    vocab, labels, mask, hidden, weight = batch()
    got = {}
    for fused in (False, True):
        cfg = NumericLossConfig(kind=kind, fused_output=fused, fused_chunk_tokens=7)
        head = NumericLossHead(vocab, cfg, weight)
        if fused:
            out = head(labels, mask, group, hidden=hidden, output_weight=weight)
        else:
            out = head(labels, mask, group, logits=hidden @ weight.T)
        hidden.grad = weight.grad = None
        out.loss.backward()
        got[fused] = (out, hidden.grad.clone(), weight.grad.clone())
    (plain, plain_h, plain_w), (fused, fused_h, fused_w) = got[False], got[True]
    assert_close(fused.per_token, plain.per_token, atol=1e-10, what="per_token")
    for key in plain.stats:
        assert_close(fused.stats[key], plain.stats[key], atol=1e-10, what=key)
    assert_close(fused_h, plain_h, atol=1e-10, what="grad hidden")
    assert_close(fused_w, plain_w, atol=1e-10, what="grad weight")


def test_emo_cost_embedding_is_a_persistent_buffer_taken_from_the_given_weights():
    vocab, _, _, _, weight = batch(torch.float32)
    head = NumericLossHead(vocab, NumericLossConfig(kind="emo"), weight)
    assert list(head.state_dict()) == ["emo_cost_embedding"]
    assert torch.equal(head.emo_cost_embedding, emo_cost_embedding(weight))
    trained = weight.detach() * 2 + 1
    head.take_cost_embedding(trained)
    assert torch.equal(head.emo_cost_embedding, emo_cost_embedding(trained))
    assert list(NumericLossHead(vocab, NumericLossConfig(kind="del"), weight).state_dict()) == []
    with pytest.raises(ValueError, match="needs the output weights"):
        NumericLossHead(vocab, NumericLossConfig(kind="emo"))


def test_the_head_takes_hidden_or_logits(group):
    vocab, labels, mask, hidden, weight = batch()
    head = NumericLossHead(vocab, NumericLossConfig(fused_output=True))
    with pytest.raises(ValueError, match="either hidden"):
        head(labels, mask, group, hidden=hidden, logits=hidden @ weight.T)
    with pytest.raises(ValueError, match="needs output_weight"):
        head(labels, mask, group, hidden=hidden)


def test_an_emo_checkpoint_saved_before_the_head_loads_its_cost_embedding():
    """Before the loss head the buffer was the model's own `emo_cost_embedding`; a strict
    load (DeepSpeed's resume) of such a state dict finds it as `head.emo_cost_embedding`."""
    from del_megatron.models.gpt import emo_buffer_saved_before_the_head

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Module()
            self.head.register_buffer("emo_cost_embedding", torch.zeros(3, 2))
            self.register_load_state_dict_pre_hook(emo_buffer_saved_before_the_head)

    saved = torch.arange(6.0).reshape(3, 2)
    model = Model()
    model.load_state_dict({"emo_cost_embedding": saved}, strict=True)
    assert torch.equal(model.head.emo_cost_embedding, saved)
    model.load_state_dict({"head.emo_cost_embedding": saved + 1}, strict=True)  # today's name
    assert torch.equal(model.head.emo_cost_embedding, saved + 1)
