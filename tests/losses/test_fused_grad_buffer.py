"""The fused output layer + loss: where its weight gradient goes and what it allocates, how
many products it makes, and its choice between the gradient formed in forward and the
recomputing backward. One process, a world of one rank (the tensor-parallel cases are in
tests/distributed/workers/tp_fused.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding
from del_megatron.losses import fused as fused_op
from del_megatron.losses import vocab_parallel_numeric_loss
from del_megatron.losses.fused import common_factor, vocab_parallel_fused_numeric_loss

aten = torch.ops.aten
VOCAB, HIDDEN, SEQ, BATCH, CHUNK = 1024, 16, 40, 2, 8
CHUNKS = -(-SEQ * BATCH // CHUNK)


class Allocations(TorchDispatchMode):
    """Every new storage an operation returns while active (not a view or an in-place result
    of one of its inputs), as (dtype, bytes); and the matrix products made."""

    def __enter__(self):
        self.made = []
        self.products = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (aten.mm, aten.addmm, aten.addmm_):
            self.products += 1
        out = func(*args, **kwargs)
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.made.append((t.dtype, t.untyped_storage().nbytes()))
        return out

    def weight_sized(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> int:
        """How many new storages of at least the weight's size (of `dtype`, if given)."""
        size = weight.numel() * weight.element_size()
        return sum(1 for d, n in self.made if n >= size and (dtype is None or d == dtype))


def case(dtype):
    gen = torch.Generator().manual_seed(0)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=VOCAB)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[:, ::3] = torch.randint(10, 20, (BATCH, (SEQ + 2) // 3), generator=gen)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) / 4
    return hidden.to(dtype), weight.to(dtype), labels, vocab


def reference(hidden, weight, labels, vocab, group, kind="del", weighting=None):
    """Gradients of hidden and weight through the unfused op on float64 logits."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    cost = emo_cost_embedding(w.detach()) if kind == "emo" else None
    out = vocab_parallel_numeric_loss(
        h @ w.T, labels, vocab, NumericLossConfig(kind=kind), group=group, cost_embedding=cost
    )
    objective = out.loss if weighting is None else (out.per_token * weighting).sum()
    objective.backward()
    return h.grad, w.grad


def fused(
    hidden, weight, labels, vocab, group, kind="del", recompute=False, chunk=CHUNK, **options
):
    cost = emo_cost_embedding(weight.detach()) if kind == "emo" else None
    return vocab_parallel_fused_numeric_loss(
        hidden,
        weight,
        labels,
        vocab,
        NumericLossConfig(kind=kind),
        group=group,
        cost_embedding=cost,
        chunk_tokens=chunk,
        recompute=recompute,
        **options,
    )


@pytest.mark.parametrize(
    ("kind", "recompute"), [("del", False), ("del", True), ("emo", False)]
)  # emo: always the recomputing backward
@pytest.mark.parametrize("held", [True, False], ids=["grad-held", "grad-fresh"])
def test_float32_weight_gradient_makes_no_second_buffer(group, kind, recompute, held):
    """Backward makes no weight-sized tensor when `.grad` is held (the gradient formed in
    forward is added into it, or the recomputing backward sums into it), and at most the one
    that becomes `.grad` when there is none; post-accumulate hooks see the summed `.grad`."""
    hidden, weight, labels, vocab = case(torch.float32)
    w = weight.clone().requires_grad_()
    before = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
    w.grad = before.clone() if held else None
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.sum()))
    out = fused(hidden, w, labels, vocab, group, kind, recompute)
    with Allocations() as alloc:
        out.loss.backward()
    assert len(seen) == 1 and torch.equal(seen[0], w.grad.sum())
    made_in_forward = kind != "emo" and not recompute
    assert alloc.weight_sized(weight) == (0 if held or made_in_forward else 1), alloc.made
    _, want = reference(hidden, weight, labels, vocab, group, kind)
    got = w.grad - before if held else w.grad
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True], ids=["forward", "recompute"])
@pytest.mark.parametrize("held", [True, False], ids=["grad-held", "grad-fresh"])
def test_bf16_weight_gradient_never_weight_sized_in_bf16(group, recompute, held):
    """Issue 17: bf16 weights accumulate the weight gradient in float32 (no chunk product in
    bf16 the size of the weight); a held bf16 `.grad` receives the float32 sum in place, so
    no weight-sized bf16 tensor exists at all; without one, the one cast to bf16 is the
    gradient itself. Values against float64 within bf16's rounding of the inputs."""
    hidden, weight, labels, vocab = case(torch.bfloat16)
    w = weight.clone().requires_grad_()
    w.grad = torch.zeros_like(w) if held else None
    with Allocations() as alloc:
        out = fused(hidden, w, labels, vocab, group, recompute=recompute)
        out.loss.backward()
    assert alloc.weight_sized(weight, torch.bfloat16) == (0 if held else 1), alloc.made
    assert w.grad.dtype == torch.bfloat16
    _, want_w = reference(hidden, weight, labels, vocab, group)
    torch.testing.assert_close(w.grad.double(), want_w, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("recompute", [False, True], ids=["forward", "recompute"])
def test_bf16_weight_gradient_goes_into_megatrons_main_grad_unrounded(group, recompute):
    """Issue 50, item 6: under megatron's DistributedDataParallel (a float32 `main_grad`
    beside the weight, `grad_added_to_main_grad` reset by its zero_grad_buffer) the float32
    sum is added into main_grad, as megatron's own layers do with gradient-accumulation
    fusion, and the weight marked so megatron's hook drops the `.grad` autograd gets. Failed
    on the code before: the sum came back as a bf16 `.grad` (rounded), main_grad untouched."""
    hidden, weight, labels, vocab = case(torch.bfloat16)
    w = weight.clone().requires_grad_()
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)  # as megatron's DDP sets them
    w.grad_added_to_main_grad = False
    out = fused(hidden, w, labels, vocab, group, recompute=recompute)
    out.loss.backward()
    assert w.grad_added_to_main_grad
    assert not torch.equal(w.main_grad, w.main_grad.bfloat16().float())  # not rounded
    _, want_w = reference(hidden, weight, labels, vocab, group)
    torch.testing.assert_close(w.main_grad.double(), want_w, rtol=2e-2, atol=2e-3)
    assert not w.grad.any()  # what megatron's hook drops


@pytest.mark.parametrize("recompute", [False, True], ids=["forward", "recompute"])
def test_three_products_per_chunk_and_one_without_grad(group, recompute):
    """The gradient formed in forward costs megatron's three products per chunk (logits,
    input gradient, weight gradient); the recomputing backward four; no grad, one."""
    hidden, weight, labels, vocab = case(torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with Allocations() as alloc:
        out = fused(h, w, labels, vocab, group, recompute=recompute)
        out.loss.backward()
    assert alloc.products == (4 if recompute else 3) * CHUNKS
    with torch.no_grad(), Allocations() as alloc:
        fused(h, w, labels, vocab, group)
    assert alloc.products == CHUNKS


@pytest.mark.parametrize("chunk", [7, 1000])
def test_values_for_a_multiple_and_for_arbitrary_incoming_gradients(group, chunk):
    """float64: `loss` times a constant, a 0/1-masked sum of per_token (multiples of the
    prediction: the forward-formed gradient, scaled) and per_token weighted by arbitrary
    values (not: the recomputing backward) all give the unfused op's gradients, with `.grad`
    absent or present, for chunk sizes that do and do not divide the tokens."""
    hidden, weight, labels, vocab = case(torch.float64)
    gen = torch.Generator().manual_seed(2)
    mask01 = (torch.rand(labels.shape, generator=gen) > 0.3).double()
    arbitrary = torch.rand(labels.shape, generator=gen, dtype=torch.float64) * 3 - 1
    for weighting in (None, mask01 * 3.7, arbitrary):
        want_h, want_w = reference(hidden, weight, labels, vocab, group, weighting=weighting)
        for existing in (None, torch.full(weight.shape, 0.5, dtype=torch.float64)):
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()
            w.grad = existing.clone() if existing is not None else None
            out = fused(h, w, labels, vocab, group, chunk=chunk)
            objective = out.loss * 2.5 if weighting is None else (out.per_token * weighting).sum()
            objective.backward()
            if weighting is None:
                want_h2, want_w2 = want_h * 2.5, want_w * 2.5
            else:
                want_h2, want_w2 = want_h, want_w
            got_w = w.grad - (existing if existing is not None else 0)
            torch.testing.assert_close(h.grad, want_h2, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(got_w, want_w2, rtol=1e-10, atol=1e-12)


def test_common_factor():
    """The check that decides between the formed gradient and recomputation: a multiple
    within rounding passes with its factor, one token's weight off by 1e-4 does not."""
    predicted = [torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([[0.2, -0.1], [0.0, 0.0]])]
    got = [p * 0.125 for p in predicted]
    assert common_factor(got, predicted) == pytest.approx(0.125, rel=1e-7)
    got[0][2] *= 1 + 1e-4
    assert common_factor(got, predicted) is None
    zeros = [torch.zeros(4), torch.zeros(2, 2)]
    assert common_factor(zeros, [torch.zeros(4), torch.zeros(2, 2)]) == 0.0
    assert common_factor(got, [torch.zeros(4), torch.zeros(2, 2)]) is None
    # non-finite values pass (the step is skipped): also against a zero prediction, where the
    # promised path's device assertion would otherwise end the run
    nan = [torch.full((4,), float("nan")), torch.zeros(2, 2)]
    assert common_factor(nan, [torch.zeros(4), torch.zeros(2, 2)]) == 0.0


def test_grad_of_a_non_leaf_weight(group):
    """A weight computed from a leaf (no .grad of its own) still gets its gradient."""
    hidden, weight, labels, vocab = case(torch.float64)
    _, expected = reference(hidden, weight, labels, vocab, group)
    leaf = weight.clone().requires_grad_()
    out = fused(hidden, leaf * 1.0, labels, vocab, group)
    out.loss.backward()
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-10, atol=1e-12)


def test_second_backward_is_refused(group):
    hidden, weight, labels, vocab = case(torch.float64)
    w = weight.clone().requires_grad_()
    out = fused(hidden, w, labels, vocab, group)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.loss.backward()


def mask_of(labels: torch.Tensor) -> torch.Tensor:
    """A 0/1 loss mask [b, s] with about a third of the positions off."""
    return (torch.rand(labels.shape, generator=torch.Generator().manual_seed(5)) > 0.3).float()


@pytest.mark.parametrize("kind", ["del", "mixce", "ntl_was", "mle"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_promised_backward_equals_the_checked_one(group, kind, dtype, monkeypatch):
    """`promise_scaled_loss` (the trainer's): the factor stays on the device instead of being
    read, and the gradients are the checked backward's bit for bit (the same float64 factor,
    applied the same way), with `.grad` absent or held; neither recomputes."""

    def no_recompute(*args):
        raise AssertionError("the loss' own gradient, scaled, was recomputed")

    monkeypatch.setattr(fused_op, "_recomputed", no_recompute)
    hidden, weight, labels, vocab = case(dtype)
    mask = mask_of(labels)
    for held in (False, True):
        grads = []
        for promise in (False, True):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            w.grad = torch.full_like(w, 0.5) if held else None
            out = fused(
                h, w, labels, vocab, group, kind, loss_mask=mask, promise_scaled_loss=promise
            )
            ((out.per_token * mask).sum() * 0.37).backward()  # loss_func's sum, then a scale
            grads.append((h.grad, w.grad))
        (checked_h, checked_w), (promised_h, promised_w) = grads
        assert torch.equal(promised_h, checked_h) and torch.equal(promised_w, checked_w)


@pytest.mark.parametrize("broken", ["second-term", "weighted", "statistic"])
def test_a_broken_promise_fails_loudly(group, broken):
    """An incoming gradient that is not the loss' own times one factor, under the promise:
    backward raises (on CUDA the device assertion fires at the next synchronisation), rather
    than hand over the scaled forward gradient. Without the promise the same backward
    recomputes and gives the unfused op's gradients (test above this one's neighbours)."""
    hidden, weight, labels, vocab = case(torch.float64)
    mask = mask_of(labels)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused(h, w, labels, vocab, group, loss_mask=mask, promise_scaled_loss=True)
    objective = (out.per_token * mask).sum()
    if broken == "second-term":  # one token counted twice
        objective = objective + out.per_token[0, 3]
    elif broken == "weighted":
        objective = (out.per_token * mask * torch.linspace(0.5, 2.0, labels.shape[1])).sum()
    else:  # a statistic's gradient: the numeric term alone
        objective = objective + out.numeric
    with pytest.raises(RuntimeError, match="promise_scaled_loss"):
        objective.backward()
