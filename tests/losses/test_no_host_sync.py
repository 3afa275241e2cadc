"""The loss ops never wait for the device: forward and backward of the vocabulary-parallel op
and of the fused op, for every kind, under `tests/distributed/residency.Residency`, which
counts each host synchronisation our code makes: reads (`.item()`, `.tolist()`, ...), shapes
that depend on a device tensor's values (`nonzero`, boolean-mask indexing, ...) and blocking
host-to-device copies (`torch.tensor` of Python data onto the device, `.to(device)` of a
host tensor). On a GPU each one stalls the host until the device has drained, once per
micro-batch.

The fused op's backward reads one thing, on purpose: whether the incoming gradient is a
multiple of the gradient it formed in forward (`fused.common_factor`; else it recomputes).

Fails on the loss code before: `nonzero` of the digit positions and `torch.tensor(float(n),
device=...)` in losses/assemble.py and losses/fused.py, 2 to 4 per call."""

from __future__ import annotations

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding
from del_megatron.losses import fused as fused_op
from del_megatron.losses import vocab_parallel, vocab_parallel_numeric_loss
from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss

from ..distributed.residency import Residency

KINDS = ["del", "mle", "ntl_was", "mixce", "emo"]


def inputs(kind: str):
    gen = torch.Generator().manual_seed(0)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=64)
    labels = torch.randint(0, 64, (2, 9), generator=gen)
    labels[:, ::2] = torch.randint(10, 20, (2, 5), generator=gen)
    labels[0, 3] = 5  # a decimal point
    hidden = torch.randn(9, 2, 8, generator=gen, requires_grad=True)
    weight = torch.randn(64, 8, generator=gen, requires_grad=True)
    cost = emo_cost_embedding(weight) if kind == "emo" else None
    return vocab, labels, hidden, weight, cost


def loss_and_backward(fused: bool, kind: str, group, vocab, labels, hidden, weight, cost):
    cfg = NumericLossConfig(kind=kind)
    mask = torch.ones(labels.shape)
    if fused:
        out = vocab_parallel_fused_numeric_loss(
            hidden, weight, labels, vocab, cfg, mask, group, cost_embedding=cost, chunk_tokens=4
        )
    else:
        logits = hidden @ weight.T
        out = vocab_parallel_numeric_loss(
            logits, labels, vocab, cfg, mask, group, cost_embedding=cost
        )
    (out.per_token * mask).sum().backward()
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_the_loss_makes_no_host_synchronisation(group, fused, kind, monkeypatch):
    case = inputs(kind)
    loss_and_backward(fused, kind, group, *case)  # the vocabulary's device tables made once
    residency = Residency()
    for function in (vocab_parallel._VocabParallelParts, fused_op._FusedParts):
        monkeypatch.setattr(function, "backward", residency.in_backward(function))
    with residency:
        loss_and_backward(fused, kind, group, *case)
    places = residency.sync_places["setup"]
    # the fused backward's one read, where it has a gradient formed in forward to check
    expected = (
        1
        if fused and NumericLossConfig(kind=kind).kind_spec.per_token_weights_known_in_forward
        else 0
    )
    assert len(places) == expected, places
    assert all("common_factor" in place or "fused.py" in place for place in places), places
