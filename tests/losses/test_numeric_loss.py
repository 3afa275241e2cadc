"""numeric_loss against explicit loops, gradcheck, masks, dtypes, padding, accumulation."""

from __future__ import annotations

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding, numeric_loss
from del_megatron.losses import DIGIT_KINDS

from ..utils import assert_close
from .batches import DIGIT_IDS, POINT_IDS, VOCAB_SIZE, make_batch, make_vocab
from .reference_loops import loop_loss

ALL_KINDS = ["mle", "del", "del_distance", "ntl_was", "ntl_mse", "dist2", "mixce", "emo"]


def _loop_cfg(cfg: NumericLossConfig) -> dict:
    return {
        "kind": cfg.kind,
        "alpha": cfg.resolved_alpha,
        "normalize": cfg.normalize,
        "place_weighting": cfg.resolved_place_weighting,
        "slope": cfg.place_slope,
        "base": cfg.decimal_base,
        "point_class": cfg.include_decimal_point,
        "tau": cfg.dist2_tau,
        "eta": cfg.mixce_eta,
        "ignore_index": cfg.ignore_index,
        "shift_invariant": cfg.shift_invariant,
    }


def _digit_ids_as_lists():
    return [ids if isinstance(ids, list) else [ids] for ids in DIGIT_IDS]


CASES = [
    NumericLossConfig(kind="del"),
    NumericLossConfig(kind="del", normalize="tokens", alpha=0.3),
    NumericLossConfig(kind="del", include_decimal_point=True, place_slope=1.5, decimal_base=1.3),
    NumericLossConfig(kind="del", place_weighting=False),
    NumericLossConfig(kind="del", shift_invariant=True),
    NumericLossConfig(kind="del", shift_invariant=True, include_decimal_point=True, alpha=1.0),
    NumericLossConfig(kind="del_distance"),
    NumericLossConfig(kind="del_distance", shift_invariant=True, normalize="tokens"),
    NumericLossConfig(kind="ntl_was"),
    NumericLossConfig(kind="ntl_mse", normalize="tokens"),
    NumericLossConfig(kind="dist2", dist2_tau=0.7),
    NumericLossConfig(kind="dist2", place_weighting=True),
    NumericLossConfig(kind="mle"),
    NumericLossConfig(kind="mixce", mixce_eta=0.3),
    NumericLossConfig(kind="emo"),
]


@pytest.mark.parametrize(
    "cfg",
    CASES,
    ids=lambda c: f"{c.kind}-{c.normalize}-{c.include_decimal_point}-si{int(c.shift_invariant)}",
)
@pytest.mark.parametrize("padded", [False, True], ids=["exact-vocab", "padded-vocab"])
def test_matches_explicit_loops_in_float64(cfg, padded):
    labels, mask = make_batch(3, 48, seed=1)
    columns = VOCAB_SIZE + (8 if padded else 0)
    logits = (
        torch.randn(3, 48, columns, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        * 3
    )
    cost = emo_cost_embedding(torch.randn(columns, 6, dtype=torch.float64)).double()
    out = numeric_loss(logits, labels, make_vocab(), cfg, mask, cost_embedding=cost)
    loss, ce, numeric, n_tok, n_dig = loop_loss(
        logits.tolist(),
        labels.tolist(),
        _digit_ids_as_lists(),
        POINT_IDS,
        _loop_cfg(cfg),
        VOCAB_SIZE,
        mask=mask.tolist(),
        cost=cost.tolist(),
    )
    assert n_dig > 20 and out.stats["digits"].item() == n_dig
    assert out.stats["tokens"].item() == n_tok
    assert_close(out.loss, loss, atol=1e-12, what="loss")
    assert_close(out.ce, ce, atol=1e-12, what="ce")
    assert_close(out.numeric, numeric, atol=1e-12, what="numeric")
    assert_close(out.per_token.sum() / out.stats["tokens"], out.loss, atol=1e-12, what="per_token")


GRADCHECK_CASES = [k for k in ALL_KINDS if k not in ("mixce", "emo")]


@pytest.mark.parametrize("kind", GRADCHECK_CASES)
@pytest.mark.parametrize("normalize", ["digits", "tokens"])
def test_gradcheck_float64(kind, normalize):
    labels, mask = make_batch(2, 12, seed=3)
    logits = torch.randn(2, 12, VOCAB_SIZE + 3, dtype=torch.float64, requires_grad=True)
    cfg = NumericLossConfig(kind=kind, normalize=normalize)
    vocab = make_vocab()

    def f(z):
        out = numeric_loss(z, labels, vocab, cfg, mask)
        return out.loss, out.per_token

    assert torch.autograd.gradcheck(f, (logits,))


def test_gradcheck_decimal_point_class():
    labels, _ = make_batch(2, 12, seed=5)
    logits = torch.randn(2, 12, VOCAB_SIZE, dtype=torch.float64, requires_grad=True)
    cfg = NumericLossConfig(kind="del", include_decimal_point=True)
    assert torch.autograd.gradcheck(
        lambda z: numeric_loss(z, labels, make_vocab(), cfg).loss, (logits,)
    )


def _plain_ce(logits, labels, valid):
    logp = torch.log_softmax(logits[..., :VOCAB_SIZE], -1)
    ce = -logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return ce, logp


@pytest.mark.parametrize("kind", ["mixce", "emo"])
def test_stop_gradient_kinds_gradcheck_through_their_surrogate(kind):
    """MixCE and EMO stop gradients by design (sg(q), sg(CE/emo)), so their gradient is not the
    derivative of their value. It is the derivative of a surrogate whose stop-gradient factors
    are frozen at the current point: gradcheck that surrogate (plain PyTorch) and compare."""
    labels, mask = make_batch(2, 12, seed=7)
    valid = (labels != -100) & (mask != 0)
    z0 = torch.randn(2, 12, VOCAB_SIZE, dtype=torch.float64, requires_grad=True)
    cost = emo_cost_embedding(torch.randn(VOCAB_SIZE, 5, dtype=torch.float64)).double()
    out = numeric_loss(
        z0, labels, make_vocab(), NumericLossConfig(kind=kind), mask, cost_embedding=cost
    )
    (grad,) = torch.autograd.grad(out.loss, z0)

    with torch.no_grad():
        ce0, logp0 = _plain_ce(z0, labels, valid)
        q0 = torch.exp(-ce0)
        emo0 = 1 - (cost[torch.where(valid, labels, 0)] * (logp0.exp() @ cost)).sum(-1)
        ratio0 = (ce0 * valid).sum() / (emo0 * valid).sum()

    def surrogate(z):
        ce, logp = _plain_ce(z, labels, valid)
        if kind == "mixce":
            per_token = (0.5 + 0.5 * q0) * ce
        else:
            emo = 1 - (cost[torch.where(valid, labels, 0)] * (logp.exp() @ cost)).sum(-1)
            per_token = 0.5 * (ce + ratio0 * emo)
        return (per_token * valid).sum() / valid.sum()

    assert torch.autograd.gradcheck(surrogate, (z0.detach().requires_grad_(),))
    (expected,) = torch.autograd.grad(surrogate(z0), z0)
    assert_close(grad, expected, atol=1e-12, what="grad")
    assert_close(out.loss, surrogate(z0), atol=1e-12, what="value")


def test_detach_criterion_keeps_value_and_changes_gradient():
    labels, mask = make_batch(2, 24, seed=8)
    z = torch.randn(2, 24, VOCAB_SIZE, dtype=torch.float64, requires_grad=True)
    plain = numeric_loss(z, labels, make_vocab(), NumericLossConfig(kind="del"), mask)
    detached = numeric_loss(
        z, labels, make_vocab(), NumericLossConfig(kind="del", detach_criterion=True), mask
    )
    assert_close(plain.loss, detached.loss, atol=1e-14, what="value")
    (g1,) = torch.autograd.grad(plain.loss, z)
    (g2,) = torch.autograd.grad(detached.loss, z)
    assert (g1 - g2).abs().max() > 1e-6


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_masked_positions_contribute_nothing(kind):
    labels, mask = make_batch(2, 32, seed=9, mask_share=0.3)
    cost = emo_cost_embedding(torch.randn(VOCAB_SIZE, 4))
    z = torch.randn(2, 32, VOCAB_SIZE, requires_grad=True)
    cfg = NumericLossConfig(kind=kind)
    out = numeric_loss(z, labels, make_vocab(), cfg, mask, cost_embedding=cost)
    (grad,) = torch.autograd.grad(out.loss, z)
    masked = (mask == 0) | (labels == -100)
    assert grad[masked].abs().max() == 0
    assert out.per_token[masked].abs().max() == 0
    # scrambling logits at masked positions changes nothing
    z2 = z.detach().clone()
    z2[masked] = torch.randn_like(z2[masked]) * 50
    out2 = numeric_loss(z2, labels, make_vocab(), cfg, mask, cost_embedding=cost)
    assert_close(out2.loss, out.loss, atol=1e-6, what="loss")


def test_padded_columns_get_no_probability_mass():
    labels, mask = make_batch(2, 32, seed=10)
    z = torch.randn(2, 32, VOCAB_SIZE + 8, dtype=torch.float64, requires_grad=True)
    huge = z.detach().clone()
    huge[..., VOCAB_SIZE:] = 1e4
    for kind in ALL_KINDS:
        cfg = NumericLossConfig(kind=kind)
        cost = emo_cost_embedding(torch.randn(VOCAB_SIZE + 8, 4, dtype=torch.float64)).double()
        a = numeric_loss(z, labels, make_vocab(), cfg, mask, cost_embedding=cost)
        b = numeric_loss(huge, labels, make_vocab(), cfg, mask, cost_embedding=cost)
        assert_close(a.loss, b.loss, atol=1e-12, what=kind)
        (grad,) = torch.autograd.grad(a.loss, z)
        assert grad[..., VOCAB_SIZE:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_are_computed_in_float32_and_left_untouched(dtype):
    labels, mask = make_batch(2, 32, seed=11)
    z = (torch.randn(2, 32, VOCAB_SIZE) * 4).to(dtype).requires_grad_()
    before = z.detach().clone()
    out = numeric_loss(z, labels, make_vocab(), NumericLossConfig(kind="del"), mask)
    out.loss.backward()
    assert torch.equal(z.detach(), before)
    assert out.loss.dtype == torch.float32 and z.grad.dtype == dtype
    z32 = z.detach().float().requires_grad_()
    ref = numeric_loss(z32, labels, make_vocab(), NumericLossConfig(kind="del"), mask)
    ref.loss.backward()
    assert_close(out.loss, ref.loss, atol=1e-6, what="loss")
    assert_close(z.grad.float(), z32.grad.to(dtype).float(), atol=1e-6, what="grad")


def test_float32_logits_are_not_modified():
    labels, mask = make_batch(2, 32, seed=12)
    z = torch.randn(2, 32, VOCAB_SIZE, requires_grad=True)
    before = z.detach().clone()
    numeric_loss(z, labels, make_vocab(), NumericLossConfig(kind="del"), mask).loss.backward()
    assert torch.equal(z.detach(), before)


@pytest.mark.parametrize("kind", sorted(DIGIT_KINDS) + ["mle", "mixce"])
def test_token_normalized_sums_accumulate_exactly_over_micro_batches(kind):
    """Sum of per-token losses over k micro-batches / total tokens == one big batch."""
    labels, mask = make_batch(4, 40, seed=13)
    z = torch.randn(4, 40, VOCAB_SIZE, dtype=torch.float64, requires_grad=True)
    cfg = NumericLossConfig(kind=kind, normalize="tokens")
    whole = numeric_loss(z, labels, make_vocab(), cfg, mask)
    (g_whole,) = torch.autograd.grad(whole.loss, z)
    parts = [
        numeric_loss(z[i : i + 1], labels[i : i + 1], make_vocab(), cfg, mask[i : i + 1])
        for i in range(4)
    ]
    total_tokens = sum(p.stats["tokens"] for p in parts)
    accumulated = sum(p.per_token.sum() for p in parts) / total_tokens
    (g_acc,) = torch.autograd.grad(accumulated, z)
    assert_close(accumulated, whole.loss, atol=1e-12, what="loss")
    assert_close(g_acc, g_whole, atol=1e-12, what="grad")
    for key in whole.stats:
        assert_close(sum(p.stats[key] for p in parts), whole.stats[key], atol=1e-9, what=key)


def test_any_leading_shape():
    labels, mask = make_batch(2, 16, seed=14)
    z = torch.randn(2, 16, VOCAB_SIZE, dtype=torch.float64)
    ref = numeric_loss(z, labels, make_vocab(), NumericLossConfig(), mask)
    one_seq = numeric_loss(z[0], labels[0], make_vocab(), NumericLossConfig(), mask[0])
    assert one_seq.per_token.shape == (16,)
    stacked = numeric_loss(
        z.unsqueeze(0), labels.unsqueeze(0), make_vocab(), NumericLossConfig(), mask.unsqueeze(0)
    )
    assert_close(stacked.loss, ref.loss, atol=1e-14, what="3 leading dims")


def test_statistics_on_constructed_logits():
    vocab = make_vocab()
    d = [ids if isinstance(ids, int) else ids[0] for ids in DIGIT_IDS]
    labels = torch.tensor([[d[1], d[2], d[3], 0, d[9]]])
    z = torch.zeros(1, 5, VOCAB_SIZE, dtype=torch.float64)
    z[0, 0, d[1]] = 10.0  # right, argmax of the full vocabulary
    z[0, 1, d[5]] = 10.0  # predicts 5 for 2: wrong, error 3
    z[0, 2, d[3]] = 5.0
    z[0, 2, 0] = 9.0  # a non-digit wins the vocabulary, but 3 wins the digits
    z[0, 4, d[9]] = 3.0
    out = numeric_loss(z, labels, vocab, NumericLossConfig(), None)
    s = out.stats
    assert s["digits"] == 4 and s["tokens"] == 5 and s["value_digits"] == 4
    assert s["digit_correct"] == 2  # positions 0 and 4
    assert s["digit_cond_correct"] == 3  # positions 0, 2, 4
    assert s["digit_abs_error_sum"] == 3
    # the entropy of a uniform distribution over ten digits is log 10, of a peaked one ~0
    single = DigitVocab(digit_ids=d, point_ids=POINT_IDS, vocab_size=VOCAB_SIZE)
    uniform = numeric_loss(torch.zeros(1, 5, VOCAB_SIZE), labels, single, NumericLossConfig())
    assert_close(
        uniform.stats["digit_entropy_sum"] / 4, torch.tensor(2.302585093), atol=1e-6, what="H"
    )


@pytest.mark.parametrize("kind", ["del", "del_distance"])
def test_shift_invariant_term_ignores_a_common_shift_and_the_default_does_not(kind):
    """loss.shift_invariant (ours, an ablation arm): the BCE on centred class logits. Moving
    every logit by c changes no probability; the authors' term (the default) then changes,
    by about c per non-target class once the logits are large (the escape the option closes),
    the shift-invariant one does not. Its gradient is checked in float64, and the default is
    the authors' formula bit for bit (the BCE on the raw class logits)."""
    labels, mask = make_batch(2, 24, seed=11)
    z = torch.randn(2, 24, VOCAB_SIZE, dtype=torch.float64) * 3
    vocab = make_vocab()
    authors = NumericLossConfig(kind=kind)
    ours = NumericLossConfig(kind=kind, shift_invariant=True)
    for c in (-4.0, 7.5):
        moved = numeric_loss(z + c, labels, vocab, ours, mask)
        base = numeric_loss(z, labels, vocab, ours, mask)
        assert_close(moved.numeric, base.numeric, atol=1e-12, what="shift-invariant term")
        assert_close(moved.ce, base.ce, atol=1e-12, what="ce")
        raw_moved = numeric_loss(z + c, labels, vocab, authors, mask).numeric
        raw = numeric_loss(z, labels, vocab, authors, mask).numeric
        assert (raw_moved - raw).abs() > 0.1, (c, raw_moved, raw)  # the escape is open

    # the default's term equals the authors' formula computed here, bit for bit
    from del_megatron.losses.terms import del_term

    class_logits = torch.randn(40, 10, dtype=torch.float64) * 4
    target = torch.randint(10, (40,))
    onehot = torch.nn.functional.one_hot(target, 10).double()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        class_logits, onehot, reduction="none"
    )
    expected = torch.softmax(class_logits, -1) * bce
    if kind == "del_distance":
        expected = expected * (torch.arange(10).double() - target.double().unsqueeze(1)).abs()
    got = del_term(class_logits, target, detach_criterion=False, distance=kind != "del")
    assert torch.equal(got, expected.sum(-1) / 10)

    logits = torch.randn(2, 12, VOCAB_SIZE + 3, dtype=torch.float64, requires_grad=True)
    small_labels, small_mask = make_batch(2, 12, seed=3)

    def f(x):
        out = numeric_loss(x, small_labels, vocab, ours, small_mask)
        return out.loss, out.per_token

    assert torch.autograd.gradcheck(f, (logits,))


def test_shift_invariant_is_refused_where_it_changes_nothing():
    with pytest.raises(ValueError, match="shift_invariant=True changes the BCE"):
        NumericLossConfig(kind="ntl_was", shift_invariant=True)
