"""Grouped digits (number tokens of 1..m digits): places, the float64 loop oracle, gradients,
and the m = 1 bit-identity with the single-digit path (docs/losses.md)."""

from __future__ import annotations

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss
from del_megatron.losses.groups import grouped_places
from del_megatron.losses.vocab import POINT_CLASS

from ..utils import assert_close
from .batches import (
    GROUPED_OTHER_IDS,
    GROUPED_POINT_IDS,
    GROUPED_STRINGS,
    GROUPED_VOCAB_SIZE,
    make_batch,
    make_grouped_batch,
    make_grouped_vocab,
    make_vocab,
)
from .reference_loops import grouped_kinds, grouped_loop_loss, scan_grouped_places
from .test_numeric_loss import _loop_cfg

DIGIT_TERM_CASES = [
    NumericLossConfig(kind="del"),
    NumericLossConfig(kind="del", normalize="tokens", alpha=0.3),
    NumericLossConfig(kind="del", place_weighting=False, detach_criterion=True),
    NumericLossConfig(kind="del_distance", place_slope=1.5, decimal_base=1.3),
    NumericLossConfig(kind="ntl_was"),
    NumericLossConfig(kind="ntl_mse", normalize="tokens"),
    NumericLossConfig(kind="dist2", dist2_tau=0.7, place_weighting=True),
    NumericLossConfig(kind="mle"),
]


def _places_of(texts: list[str | None]) -> list[list[int]]:
    """Places from grouped_places for a sequence of digit strings / '.' / None."""
    classes = torch.tensor(
        [0 if t not in (None, ".") else (POINT_CLASS if t == "." else -1) for t in texts]
    )
    count = torch.tensor([len(t) if t not in (None, ".") else 0 for t in texts])
    place, is_slot = grouped_places(classes, count, 3)
    return [
        [int(p) for p, s in zip(row, ok, strict=True) if s]
        for row, ok in zip(place, is_slot, strict=True)
    ]


def test_places_count_digits_across_number_tokens():
    assert _places_of(["123", "45"]) == [[4, 3, 2], [1, 0]]
    assert _places_of(["1", ".", "234", "5"]) == [[0], [], [-1, -2, -3], [-4]]
    assert _places_of([".", "05"]) == [[], [-1, -2]]
    assert _places_of(["3", ".", "14", ".", "15"]) == [[0], [], [-1, -2], [], [1, 0]]
    assert _places_of(["12", None, "345", "6"]) == [[1, 0], [], [3, 2, 1], [0]]


def test_places_equal_the_loop_scan_on_random_batches():
    labels, mask = make_grouped_batch(4, 64, seed=3)
    vocab = make_grouped_vocab()
    count_table, _ = vocab.number_table(GROUPED_VOCAB_SIZE, torch.device("cpu"))
    valid = (labels != -100) & (mask != 0)
    safe = torch.where(valid, labels, 0)
    count = torch.where(valid, count_table[safe], 0)
    point = valid & torch.isin(safe, torch.tensor(GROUPED_POINT_IDS))
    classes = torch.where(count > 0, 0, torch.where(point, POINT_CLASS, -1))
    place, is_slot = grouped_places(classes, count, 3)
    for b in range(labels.shape[0]):
        kinds = grouped_kinds(
            labels[b].tolist(), GROUPED_STRINGS, GROUPED_POINT_IDS, -100, mask[b].tolist()
        )
        expected, _ = scan_grouped_places(kinds)
        for t, places in enumerate(expected):
            got = [int(p) for p, s in zip(place[b, t], is_slot[b, t], strict=True) if s]
            assert got == (places or []), (b, t, kinds[t])


@pytest.mark.parametrize("cfg", DIGIT_TERM_CASES, ids=lambda c: f"{c.kind}-{c.normalize}")
def test_grouped_loss_matches_the_loop_oracle_in_float64(cfg):
    labels, mask = make_grouped_batch(3, 40, seed=1)
    columns = GROUPED_VOCAB_SIZE + 5  # padded columns get no mass
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 40, columns, dtype=torch.float64, generator=gen) * 3
    out = numeric_loss(logits, labels, make_grouped_vocab(), cfg, mask)
    loss, ce, numeric, n_tok, n_dig = grouped_loop_loss(
        logits.tolist(), labels.tolist(), GROUPED_STRINGS, GROUPED_POINT_IDS, _loop_cfg(cfg),
        GROUPED_VOCAB_SIZE, mask=mask.tolist(),
    )  # fmt: skip
    assert n_dig > n_tok // 2 and out.stats["digits"].item() == n_dig  # digits, not tokens
    assert out.stats["tokens"].item() == n_tok
    assert_close(out.loss, loss, atol=1e-12, what="loss")
    assert_close(out.ce, ce, atol=1e-12, what="ce")
    assert_close(out.numeric, numeric, atol=1e-12, what="numeric")
    assert_close(out.per_token.sum() / out.stats["tokens"], loss, atol=1e-12, what="per_token")


@pytest.mark.parametrize("kind", ["del", "dist2", "ntl_mse"])
def test_grouped_gradient_is_the_derivative_of_the_loss(kind):
    """Directional derivative by central differences in float64 (the reference's own
    backward forms the dense gradient, not autograd)."""
    cfg = NumericLossConfig(kind=kind)
    labels, mask = make_grouped_batch(2, 24, seed=5)
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 24, GROUPED_VOCAB_SIZE, dtype=torch.float64, generator=gen)
    direction = torch.randn(logits.shape, dtype=torch.float64, generator=gen)
    x = logits.clone().requires_grad_()
    vocab = make_grouped_vocab()
    numeric_loss(x, labels, vocab, cfg, mask).loss.backward()
    eps = 1e-6
    plus = numeric_loss(logits + eps * direction, labels, vocab, cfg, mask).loss
    minus = numeric_loss(logits - eps * direction, labels, vocab, cfg, mask).loss
    assert_close((x.grad * direction).sum(), (plus - minus) / (2 * eps), atol=1e-7, what="grad")


@pytest.mark.parametrize("kind", ["del", "del_distance", "ntl_was", "ntl_mse", "dist2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_machinery_at_m1_is_the_single_digit_path_bit_for_bit(kind, dtype, monkeypatch):
    """The grouped path forced on a single-digit vocabulary: sets = the ten classes, one
    slot per token, the same places: loss, per-token losses and the logits'
    gradient equal bit for bit, the statistics within 1e-6 (another summation order)."""
    cfg = NumericLossConfig(kind=kind, normalize="tokens" if kind == "dist2" else "digits")
    labels, mask = make_batch(3, 48, seed=4)
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(3, 48, 44, generator=gen) * 3).to(dtype)

    def run():
        x = logits.clone().requires_grad_()
        out = numeric_loss(x, labels, make_vocab(), cfg, mask)
        out.per_token.sum().backward()
        return out, x.grad

    today, today_grad = run()
    monkeypatch.setattr(DigitVocab, "grouped", property(lambda self: True))
    grouped, grouped_grad = run()
    assert torch.equal(grouped.loss, today.loss) and torch.equal(grouped.per_token, today.per_token)
    # Counts equal; the float sums (entropy, abs error, numeric) only in their last bits: the
    # single-digit path sums every row with zeros off the digits (no host wait), the grouped
    # path the selected digit slots, in another order.
    for key in today.stats:
        assert_close(grouped.stats[key], today.stats[key], atol=0, rtol=1e-6, what=key)
    assert torch.equal(grouped_grad, today_grad)


@pytest.mark.parametrize("kind", ["del", "dist2"])
def test_grouped_machinery_at_m1_on_the_shard_ops_is_bit_for_bit(kind, group, monkeypatch):
    """The same forced-grouped check through the vocabulary-parallel and the fused op (one
    rank): loss, per-token losses, statistics and gradients equal bit for bit."""
    from del_megatron.losses import vocab_parallel_numeric_loss
    from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss

    cfg = NumericLossConfig(kind=kind)
    labels, mask = make_batch(2, 24, seed=9)
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(24, 2, 16, generator=gen)
    weight = torch.randn(48, 16, generator=gen)

    def run():
        shard = (hidden @ weight.T).requires_grad_()
        unfused = vocab_parallel_numeric_loss(shard, labels, make_vocab(), cfg, mask, group)
        unfused.loss.backward()
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        fused = vocab_parallel_fused_numeric_loss(
            h, w, labels, make_vocab(), cfg, mask, group, chunk_tokens=7, recompute=True
        )
        fused.loss.backward()
        outputs = [unfused.loss, unfused.per_token, shard.grad, fused.loss, fused.per_token]
        return [*outputs, h.grad, w.grad]

    today = run()
    monkeypatch.setattr(DigitVocab, "grouped", property(lambda self: True))
    grouped = run()
    assert all(torch.equal(a, b) for a, b in zip(grouped, today, strict=True))


@pytest.mark.parametrize("kind", ["del", "del_distance", "ntl_was", "ntl_mse", "dist2"])
def test_grouped_batch_without_numbers_is_plain_ce(kind):
    """A micro-batch with no number target (a stretch of prose) has no digit slot: the
    slots' set gather of [0, 10, W] members ran into view(0, -1) and crashed training."""
    gen = torch.Generator().manual_seed(4)
    others = torch.tensor(GROUPED_OTHER_IDS)
    labels = others[torch.randint(len(others), (2, 12), generator=gen)]
    logits = torch.randn(2, 12, GROUPED_VOCAB_SIZE, generator=gen, dtype=torch.float64)
    logits.requires_grad_(True)
    out = numeric_loss(logits, labels, make_grouped_vocab(), NumericLossConfig(kind=kind))
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert out.stats["digits"].item() == 0 and out.numeric.item() == 0.0
    assert_close(out.loss, ce, atol=1e-12, what="loss")
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("kind", ["del", "ntl_was", "dist2", "mixce"])
def test_grouped_fused_op_hands_over_the_gradient_formed_in_forward(kind, group, monkeypatch):
    """The fused op forms a grouped vocabulary's gradient in forward (its prediction goes
    through the slots' set log-sum-exps as `assemble` does) and hands it over for the loss,
    scaled, with and without the caller's promise: no recompute, the unfused op's gradients
    within 1e-10 (float64). Before, grouped vocabularies always recomputed (a fourth product)."""
    from del_megatron.losses import fused as fused_op
    from del_megatron.losses import vocab_parallel_numeric_loss

    def no_recompute(*args):
        raise AssertionError("recomputed")

    monkeypatch.setattr(fused_op, "_recomputed", no_recompute)
    cfg = NumericLossConfig(kind=kind)
    vocab = make_grouped_vocab()
    labels, mask = make_grouped_batch(2, 30, seed=6)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(30, 2, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(GROUPED_VOCAB_SIZE, 8, generator=gen, dtype=torch.float64)
    shard = (hidden @ weight.T).requires_grad_()
    unfused = vocab_parallel_numeric_loss(shard, labels, vocab, cfg, mask, group)
    (unfused.loss * 0.6).backward()
    want_h, want_w = shard.grad @ weight, shard.grad.flatten(0, 1).T @ hidden.flatten(0, 1)
    for promise in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_op.vocab_parallel_fused_numeric_loss(
            h, w, labels, vocab, cfg, mask, group, chunk_tokens=7, promise_scaled_loss=promise
        )
        (out.loss * 0.6).backward()
        assert_close(h.grad, want_h, atol=1e-10, what=f"grad hidden, promise={promise}")
        assert_close(w.grad, want_w, atol=1e-10, what=f"grad weight, promise={promise}")
