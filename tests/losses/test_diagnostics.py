"""Is DEL learned from or escaped (docs/losses.md, diagnostics): the digit-logit level and the
gradient probe, on the single-device op in float64.

* A common shift c of every vocabulary logit (which softmax ignores) raises `digit_logit`
  and `digit_logsumexp` by exactly c, leaves CE and the digit entropy as they were, and
  raises DEL's term: the escape the level statistics are there to show. Fails on
  statistics of the digit distribution (they do not move) or of the centred logits.
* `output_gradient_probe` equals the share and cosine of gradients taken directly: CE's by
  torch's own cross entropy, the whole loss' by autograd through `out.loss` (float64, 1e-10
  relative: the two are sums of the same products in another order).

The tensor-parallel value equality of both is tests/distributed/workers/tp_gpt.py (TP 2
against TP 1, through the model's forward).
"""

from __future__ import annotations

import pytest
import torch

from del_megatron import NumericLossConfig, numeric_loss
from del_megatron.losses.diagnostics import output_gradient_probe

from ..utils import assert_close
from .batches import (
    GROUPED_VOCAB_SIZE,
    OTHER_IDS,
    VOCAB_SIZE,
    make_batch,
    make_grouped_batch,
    make_grouped_vocab,
    make_vocab,
)

SHIFT = 3.0


def case(grouped: bool, padded: bool = False):
    """(vocab, labels, mask, logits [b, s, V] float64) with digit targets."""
    if grouped:
        vocab, size = make_grouped_vocab(), GROUPED_VOCAB_SIZE
        labels, mask = make_grouped_batch(3, 17, seed=4)
    else:
        vocab, size = make_vocab(), VOCAB_SIZE
        labels, mask = make_batch(3, 17, seed=4)
    columns = size + (8 if padded else 0)  # padding columns: excluded from every softmax
    gen = torch.Generator().manual_seed(11)
    # logits at the level MLE gives digit classes (a few units above 0), where DEL's BCE of a
    # non-target class is about its logit
    logits = 2.0 * torch.randn(*labels.shape, columns, generator=gen, dtype=torch.float64) + 4.0
    return vocab, labels, mask, logits


def means(out) -> dict[str, float]:
    s = out.stats
    return {
        "ce": s["ce_sum"] / s["tokens"],
        "digit_entropy": s["digit_entropy_sum"] / s["digits"],
        "digit_logit": s["digit_logit_sum"] / s["digits"],
        "digit_logsumexp": s["digit_logsumexp_sum"] / s["digits"],
        "numeric": out.numeric,
    }


@pytest.mark.parametrize("grouped", [False, True], ids=["single", "grouped"])
def test_a_common_shift_moves_the_level_and_the_del_term_only(grouped):
    vocab, labels, mask, logits = case(grouped, padded=not grouped)
    cfg = NumericLossConfig(kind="del")
    before = means(numeric_loss(logits, labels, vocab, cfg, mask))
    after = means(numeric_loss(logits + SHIFT, labels, vocab, cfg, mask))
    for key in ("digit_logit", "digit_logsumexp"):  # exactly c, to float64 rounding
        assert_close(after[key] - before[key], torch.tensor(SHIFT), atol=1e-12, what=key)
    for key in ("ce", "digit_entropy"):  # what softmax sees: unchanged
        assert_close(after[key], before[key], atol=1e-12, what=key)
    # the escape: the term rises with the level (and falls with it: a shift down lowers it)
    assert after["numeric"] > before["numeric"] + 0.5 * SHIFT / 10
    lowered = means(numeric_loss(logits - SHIFT, labels, vocab, cfg, mask))
    assert lowered["numeric"] < before["numeric"]


def direct_gradients(logits, labels, mask, vocab, cfg):
    """(grad of CE, grad of the loss) by autograd, CE as torch's own cross entropy."""
    z = logits.clone().requires_grad_(True)
    valid = (labels != cfg.ignore_index) & (mask != 0)
    columns = vocab.vocab_size  # padding columns excluded, as in the losses
    per_token = torch.nn.functional.cross_entropy(
        z[..., :columns].reshape(-1, columns),
        torch.where(valid, labels, 0).reshape(-1),
        reduction="none",
    )
    ce = (per_token * valid.reshape(-1)).sum() / valid.sum()
    (g_ce,) = torch.autograd.grad(ce, z)
    z = logits.clone().requires_grad_(True)
    (g_loss,) = torch.autograd.grad(numeric_loss(z, labels, vocab, cfg, mask).loss, z)
    return g_ce, g_loss


@pytest.mark.parametrize(
    ("kind", "grouped", "alpha"),
    [("del", False, 0.1), ("del", False, 3.0), ("del", True, 0.1), ("ntl_was", False, 0.3)],
)
def test_gradient_probe_equals_direct_autograd(kind, grouped, alpha):
    vocab, labels, mask, logits = case(grouped, padded=True)
    cfg = NumericLossConfig(kind=kind, alpha=alpha)

    def loss_of(z):
        return numeric_loss(z, labels, vocab, cfg, mask)

    probe = output_gradient_probe(loss_of, logits, cfg.resolved_alpha)
    g_ce, g_loss = direct_gradients(logits, labels, mask, vocab, cfg)
    g_num = g_loss - g_ce
    share = g_num.norm() / g_loss.norm()
    cos = (g_num * g_ce).sum() / (g_num.norm() * g_ce.norm())
    assert probe["numeric_grad_probes"].item() == 1.0
    assert probe["numeric_grad_cos_probes"].item() == 1.0
    assert_close(probe["numeric_grad_share_sum"], share, atol=0, rtol=1e-10, what="share")
    assert_close(probe["numeric_grad_cos_sum"], cos, atol=1e-10, what="cos")
    assert 0 < share < 1 and -1 <= cos <= 1


def test_gradient_probe_of_a_batch_without_digits_counts_no_cosine():
    vocab, labels, mask, logits = case(False)
    table = vocab.class_table(VOCAB_SIZE, labels.device)  # class of each id, NOT_A_CLASS < 0
    labels = torch.where(table[labels.clamp(min=0)] >= 0, OTHER_IDS[0], labels)
    cfg = NumericLossConfig(kind="del")
    probe = output_gradient_probe(
        lambda z: numeric_loss(z, labels, vocab, cfg, mask), logits, cfg.resolved_alpha
    )
    # the term has no gradient: its share is 0 (counted), its cosine undefined (not counted)
    assert probe["numeric_grad_probes"].item() == 1.0
    assert probe["numeric_grad_share_sum"].item() == 0.0
    assert probe["numeric_grad_cos_probes"].item() == 0.0
    assert probe["numeric_grad_cos_sum"].item() == 0.0
