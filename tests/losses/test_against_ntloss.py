"""ntl_was / ntl_mse agree with the reference implementation, PyPI `ntloss` (offline)."""

from __future__ import annotations

import copy

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss

from ..utils import assert_close

ntloss = pytest.importorskip("ntloss")


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "▁the", "▁price", "▁is", ".", ",", "▁", *[str(k) for k in range(10)], "▁and"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.parametrize(
    ("kind", "reference"),
    [("ntl_was", "NTLoss"), ("ntl_mse", "NTLossDotProduct")],
)
@pytest.mark.parametrize("with_mask", [False, True])
def test_matches_ntloss(hf_tokenizer, kind, reference, with_mask):
    vocab = DigitVocab.from_hf(hf_tokenizer)
    size = vocab.vocab_size
    ref = getattr(ntloss, reference)(copy.deepcopy(hf_tokenizer), vocab_size=size, reweigh=False)
    gen = torch.Generator().manual_seed(0)
    texts = ["the price is 1234.5 and 67,890", "the price is 3.14 and 2026", "and 999 is 0.001"]
    ids = [hf_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    seq = max(len(i) for i in ids)
    labels = torch.tensor([i + [-100] * (seq - len(i)) for i in ids])
    logits = torch.randn(len(texts), seq, size, generator=gen) * 2
    mask = (torch.rand(labels.shape, generator=gen) > 0.25).float() if with_mask else None

    out = numeric_loss(logits, labels, vocab, NumericLossConfig(kind=kind), mask)
    expected = ref(logits, labels, loss_weights=mask)
    assert out.stats["digits"] > 5
    # ntloss works in float32: its sum of ~50 terms near 17 carries ~1e-7 relative error
    assert_close(out.numeric, expected, atol=1e-6, rtol=1e-6, what=kind)
