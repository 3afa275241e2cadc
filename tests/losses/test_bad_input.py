"""Bad input raises an error naming the problem; valid input never yields NaN."""

from __future__ import annotations

import pydantic
import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, emo_cost_embedding, numeric_loss

from .batches import VOCAB_SIZE, make_batch, make_vocab

ALL_KINDS = ["mle", "del", "del_distance", "ntl_was", "ntl_mse", "dist2", "mixce", "emo"]


def test_shape_mismatch():
    with pytest.raises(ValueError, match=r"logits \(2, 5, 40\) do not match labels \(2, 4\)"):
        numeric_loss(torch.randn(2, 5, 40), torch.zeros(2, 4, dtype=torch.long), make_vocab())


def test_label_out_of_range():
    labels = torch.zeros(2, 5, dtype=torch.long)
    labels[1, 3] = 40
    with pytest.raises(ValueError, match="a label is out of range for a vocabulary of 40"):
        numeric_loss(torch.randn(2, 5, 40), labels, make_vocab())
    labels[1, 3] = -7
    with pytest.raises(ValueError, match="a label is out of range"):
        numeric_loss(torch.randn(2, 5, 40), labels, make_vocab())


def test_tokenizer_larger_than_logits():
    with pytest.raises(
        ValueError, match="logits have 30 vocabulary columns but the tokenizer has 40"
    ):
        numeric_loss(torch.randn(2, 5, 30), torch.zeros(2, 5, dtype=torch.long), make_vocab())


def test_wrong_dtypes_and_mask_shape():
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        numeric_loss(torch.randn(2, 5, 40), torch.zeros(2, 5), make_vocab())
    with pytest.raises(ValueError, match=r"loss_mask \(2, 4\) does not match labels \(2, 5\)"):
        numeric_loss(
            torch.randn(2, 5, 40),
            torch.zeros(2, 5, dtype=torch.long),
            make_vocab(),
            loss_mask=torch.ones(2, 4),
        )


def test_unknown_kind_and_option():
    with pytest.raises(pydantic.ValidationError, match="kind"):
        NumericLossConfig(kind="focal")
    with pytest.raises(pydantic.ValidationError, match="alpah"):
        NumericLossConfig(kind="del", alpah=0.1)
    with pytest.raises(pydantic.ValidationError, match="decimal_base"):
        NumericLossConfig(decimal_base=-1)
    with pytest.raises(
        pydantic.ValidationError, match="include_decimal_point=True needs kind='del'"
    ):
        NumericLossConfig(kind="ntl_was", include_decimal_point=True)
    with pytest.raises(pydantic.ValidationError, match="place_weighting=True has no effect"):
        NumericLossConfig(kind="mle", place_weighting=True)


def test_emo_needs_a_cost_embedding():
    with pytest.raises(ValueError, match="cost_embedding"):
        numeric_loss(
            torch.randn(2, 5, 40),
            torch.zeros(2, 5, dtype=torch.long),
            make_vocab(),
            NumericLossConfig(kind="emo"),
        )
    with pytest.raises(ValueError, match=r"cost_embedding must be \[vocab >= 40, hidden\]"):
        numeric_loss(
            torch.randn(2, 5, 40),
            torch.zeros(2, 5, dtype=torch.long),
            make_vocab(),
            NumericLossConfig(kind="emo"),
            cost_embedding=torch.randn(10, 4),
        )


def test_decimal_point_class_needs_a_point_token():
    vocab = DigitVocab(digit_ids=list(range(10)), vocab_size=40)
    with pytest.raises(ValueError, match="no '.' token"):
        numeric_loss(
            torch.randn(2, 5, 40),
            torch.zeros(2, 5, dtype=torch.long),
            vocab,
            NumericLossConfig(include_decimal_point=True),
        )


def _finite(out, z):
    (grad,) = torch.autograd.grad(out.loss, z)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in out.stats.values())
    return grad


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_batch_without_digits(kind):
    labels = torch.full((2, 8), 0, dtype=torch.long)  # id 0 is no digit
    z = torch.randn(2, 8, VOCAB_SIZE, requires_grad=True)
    cost = emo_cost_embedding(torch.randn(VOCAB_SIZE, 4))
    out = numeric_loss(z, labels, make_vocab(), NumericLossConfig(kind=kind), cost_embedding=cost)
    _finite(out, z)
    assert out.stats["digits"] == 0
    if kind != "emo":
        assert out.numeric.item() == 0.0


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_fully_masked_batch(kind):
    labels, _ = make_batch(2, 8)
    z = torch.randn(2, 8, VOCAB_SIZE, requires_grad=True)
    cost = emo_cost_embedding(torch.randn(VOCAB_SIZE, 4))
    out = numeric_loss(
        z,
        labels,
        make_vocab(),
        NumericLossConfig(kind=kind),
        torch.zeros(2, 8),
        cost_embedding=cost,
    )
    grad = _finite(out, z)
    assert out.loss.item() == 0.0 and grad.abs().max() == 0


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_extreme_logits_stay_finite(kind):
    labels, mask = make_batch(2, 32, seed=3)
    z = (torch.randn(2, 32, VOCAB_SIZE) * 1e4).requires_grad_()
    cost = emo_cost_embedding(torch.randn(VOCAB_SIZE, 4))
    _finite(
        numeric_loss(
            z, labels, make_vocab(), NumericLossConfig(kind=kind), mask, cost_embedding=cost
        ),
        z,
    )
