"""The fused output layer + loss sums its weight gradient into the parameter's own `.grad`
when that buffer exists (as training holds it), instead of a second weight-sized tensor:
what the memory goal of bench/loss_fused.py rests on. One process, a world of one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding
from del_megatron.losses import vocab_parallel_numeric_loss
from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss

VOCAB, HIDDEN, SEQ, BATCH, CHUNK = 1024, 16, 40, 2, 8


@pytest.fixture(scope="module")
def group():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()


class LargestAllocation(TorchDispatchMode):
    """The largest new storage any operation returns while active (not a view or an
    in-place result of one of its inputs)."""

    def __enter__(self):
        self.largest = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def case(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=VOCAB)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[:, ::3] = torch.randint(10, 20, (BATCH, (SEQ + 2) // 3), generator=gen)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / 4
    return hidden.to(dtype), weight.to(dtype), labels, vocab


def reference_grad(hidden, weight, labels, vocab, group):
    w = weight.detach().double().requires_grad_()
    out = vocab_parallel_numeric_loss(
        hidden.double() @ w.T, labels, vocab, NumericLossConfig(kind="del"), group=group
    )
    out.loss.backward()
    return w.grad


@pytest.mark.parametrize("kind", ["del", "emo"])
def test_weight_gradient_lands_in_existing_grad_without_a_copy(group, kind):
    hidden, weight, labels, vocab = case(torch.float32)
    cfg = NumericLossConfig(kind=kind)
    cost = emo_cost_embedding(weight) if kind == "emo" else None

    def loss_grad(existing):
        w = weight.clone().requires_grad_()
        w.grad = existing.clone() if existing is not None else None
        seen = []
        w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.sum()))
        out = vocab_parallel_fused_numeric_loss(
            hidden, w, labels, vocab, cfg, group=group, cost_embedding=cost, chunk_tokens=CHUNK
        )
        with LargestAllocation() as alloc:
            out.loss.backward()
        assert len(seen) == 1 and torch.equal(seen[0], w.grad.sum())  # hooks see the sum
        return w.grad, alloc.largest

    fresh, _ = loss_grad(None)
    before = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
    summed, largest = loss_grad(before)
    torch.testing.assert_close(summed - before, fresh, rtol=1e-5, atol=1e-6)
    # a chunk's logits [8, 1024] are half a weight [1024, 16]: nothing weight-sized is made
    assert largest < weight.untyped_storage().nbytes(), largest


def test_gradient_values_with_and_without_existing_grad(group):
    """float64: the summed-in gradient equals the unfused op's, with .grad absent or present,
    and with a chunk size that does not divide the tokens."""
    hidden, weight, labels, vocab = case(torch.float64)
    expected = reference_grad(hidden, weight, labels, vocab, group)
    for existing in (None, torch.full(weight.shape, 0.5, dtype=torch.float64)):
        w = weight.clone().requires_grad_()
        w.grad = existing.clone() if existing is not None else None
        out = vocab_parallel_fused_numeric_loss(
            hidden, w, labels, vocab, NumericLossConfig(kind="del"), group=group, chunk_tokens=7
        )
        out.loss.backward()
        got = w.grad - (existing if existing is not None else 0)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_bf16_weight_with_bf16_grad(group):
    """Half weights: chunks summed in float32, then added once into the bf16 `.grad`."""
    hidden, weight, labels, vocab = case(torch.bfloat16)
    expected = reference_grad(hidden, weight, labels, vocab, group)
    w = weight.clone().requires_grad_()
    w.grad = torch.zeros_like(w)
    out = vocab_parallel_fused_numeric_loss(
        hidden, w, labels, vocab, NumericLossConfig(kind="del"), group=group, chunk_tokens=CHUNK
    )
    out.loss.backward()
    assert w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w.grad.double(), expected, rtol=2e-2, atol=2e-3)


def test_grad_of_a_non_leaf_weight(group):
    """A weight computed from a leaf (no .grad of its own) still gets its gradient."""
    hidden, weight, labels, vocab = case(torch.float64)
    expected = reference_grad(hidden, weight, labels, vocab, group)
    leaf = weight.clone().requires_grad_()
    out = vocab_parallel_fused_numeric_loss(
        hidden, leaf * 1.0, labels, vocab, NumericLossConfig(kind="del"), group=group
    )
    out.loss.backward()
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-10, atol=1e-12)
