"""The loss ops never wait for the device: forward and backward of the vocabulary-parallel op
and of the fused op, for every kind, single-digit and grouped vocabularies, under
`tests/distributed/residency.Residency`, which counts each host synchronisation our code
makes: reads (`.item()`, `.tolist()`, ...), shapes that depend on a device tensor's values
(`nonzero`, boolean-mask indexing, ...) and blocking host-to-device copies (`torch.tensor`
of Python data onto the device, `.to(device)` of a host tensor). On a GPU each one stalls
the host until the device has drained, once per micro-batch.

The fused op's backward reads one thing, on purpose, when its caller promised nothing:
whether the incoming gradient is a multiple of the gradient it formed in forward
(`fused.common_factor`; else it recomputes). With `promise_scaled_loss` (the trainer's) it
reads nothing.

Fails on the loss code before: `nonzero` of the digit positions and `torch.tensor(float(n),
device=...)` in losses/assemble.py and losses/fused.py, 2 to 4 per call; then 1 in the fused
backward whatever the caller, and 1 for grouped vocabularies (`nonzero` of the digit slots in
losses/groups.py)."""

from __future__ import annotations

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding
from del_megatron.losses import fused as fused_op
from del_megatron.losses import groups, vocab_parallel, vocab_parallel_numeric_loss
from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss

from ..distributed.residency import Residency
from .batches import GROUPED_VOCAB_SIZE, make_grouped_batch, make_grouped_vocab

KINDS = ["del", "mle", "ntl_was", "mixce", "emo"]
# the fused op's three ways to its backward: unfused, fused with the checked backward, fused
# with the caller's promise
PATHS = ["unfused", "fused", "fused+promise"]


def inputs(kind: str, grouped: bool):
    gen = torch.Generator().manual_seed(0)
    if grouped:
        vocab, size = make_grouped_vocab(), GROUPED_VOCAB_SIZE
        labels, _ = make_grouped_batch(2, 9, seed=1, mask_share=0.0)
    else:
        vocab, size = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=64), 64
        labels = torch.randint(0, 64, (2, 9), generator=gen)
        labels[:, ::2] = torch.randint(10, 20, (2, 5), generator=gen)
        labels[0, 3] = 5  # a decimal point
    hidden = torch.randn(9, 2, 8, generator=gen, requires_grad=True)
    weight = torch.randn(size, 8, generator=gen, requires_grad=True)
    cost = emo_cost_embedding(weight) if kind == "emo" else None
    return vocab, labels, hidden, weight, cost


def loss_and_backward(path: str, kind: str, group, vocab, labels, hidden, weight, cost):
    cfg = NumericLossConfig(kind=kind)
    mask = torch.ones(labels.shape)
    if path.startswith("fused"):
        out = vocab_parallel_fused_numeric_loss(
            hidden, weight, labels, vocab, cfg, mask, group, cost_embedding=cost,
            chunk_tokens=4, promise_scaled_loss=path == "fused+promise",
        )  # fmt: skip
    else:
        logits = hidden @ weight.T
        out = vocab_parallel_numeric_loss(
            logits, labels, vocab, cfg, mask, group, cost_embedding=cost
        )
    (out.per_token * mask).sum().backward()  # the trainer's loss_func, before its scale
    return out


def syncs_of(path: str, kind: str, grouped: bool, group, monkeypatch) -> list[str]:
    """Where the second call of the loss (forward and backward) synchronised with the host."""
    case = inputs(kind, grouped)
    loss_and_backward(path, kind, group, *case)  # the vocabulary's device tables made once
    residency = Residency()
    for function in (vocab_parallel._VocabParallelParts, fused_op._FusedParts):
        monkeypatch.setattr(function, "backward", residency.in_backward(function))
    monkeypatch.setattr(
        groups._SetLogSumExp, "backward", residency.in_backward(groups._SetLogSumExp)
    )
    with residency:
        loss_and_backward(path, kind, group, *case)
    return residency.sync_places["setup"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_the_loss_makes_no_host_synchronisation(group, path, kind, monkeypatch):
    places = syncs_of(path, kind, False, group, monkeypatch)
    # the checked backward's one read, where it has a gradient formed in forward to check
    formed = NumericLossConfig(kind=kind).kind_spec.per_token_weights_known_in_forward
    expected = 1 if path == "fused" and formed else 0
    assert len(places) == expected, places
    assert all("fused.py" in place for place in places), places  # common_factor


@pytest.mark.parametrize("kind", ["del", "ntl_was", "mixce"])
@pytest.mark.parametrize("path", PATHS)
def test_grouped_digits_make_no_host_synchronisation(group, path, kind, monkeypatch):
    """Number tokens of 1..3 digits: their digit slots are a fixed [tokens, m] layout with a
    mask, not a selection (before: a `nonzero` of the slots in losses/groups.py, one a call);
    the fused op forms their gradient in forward too, so its checked backward reads once."""
    places = syncs_of(path, kind, True, group, monkeypatch)
    assert len(places) == (1 if path == "fused" else 0), places
    assert all("fused.py" in place for place in places), places  # common_factor
