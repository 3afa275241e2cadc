"""DigitVocab from sentencepiece, Hugging Face and explicit ids; refusals; fingerprints."""

from __future__ import annotations

import copy

import pytest
import sentencepiece as spm
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from del_megatron import DigitVocab, TokenizerError
from del_megatron.losses import POINT_CLASS


def _expected_sentencepiece_ids(path):
    sp = spm.SentencePieceProcessor(model_file=str(path))
    digits = [sp.piece_to_id(str(k)) for k in range(10)]
    return sp, digits


def test_sentencepiece_split_digits_finds_ten_single_digit_classes(spm_split_digits):
    sp, digits = _expected_sentencepiece_ids(spm_split_digits)
    vocab = DigitVocab.from_sentencepiece(spm_split_digits)
    assert vocab.digit_ids == tuple((i,) for i in digits)
    assert sp.piece_to_id(".") in vocab.point_ids
    assert vocab.vocab_size == sp.get_piece_size()


def test_sentencepiece_merging_digits_is_refused_with_examples(spm_merged_digits):
    with pytest.raises(TokenizerError, match=r"merges digits.*e\.g\. '") as err:
        DigitVocab.from_sentencepiece(spm_merged_digits)
    # the examples are real multi-digit pieces of that tokenizer
    sp = spm.SentencePieceProcessor(model_file=str(spm_merged_digits))
    example = str(err.value).split("e.g. ")[1].split(",")[0].strip("'")
    assert sp.piece_to_id(example) != sp.unk_id()
    assert sum(c.isdigit() for c in example) >= 2


def test_mistral_7b_tokenizer(mistral_tokenizer_model):
    sp, digits = _expected_sentencepiece_ids(mistral_tokenizer_model)
    vocab = DigitVocab.from_sentencepiece(mistral_tokenizer_model)
    assert vocab.vocab_size == 32000
    assert vocab.digit_ids == tuple((i,) for i in digits)
    assert set(vocab.point_ids) == {sp.piece_to_id("."), sp.piece_to_id("▁.")}
    # byte-fallback pieces such as <0x35> are not digit tokens
    assert sp.piece_to_id("<0x35>") not in vocab.digit_ids[5]


def test_byte_level_bpe_with_digit_splitting(bpe_split_digits):
    vocab = DigitVocab.from_hf(bpe_split_digits)
    expected = [bpe_split_digits.token_to_id(str(k)) for k in range(10)]
    assert [ids[0] for ids in vocab.digit_ids] == expected
    assert vocab.point_ids == (bpe_split_digits.token_to_id("."),)


def test_byte_level_bpe_merging_digits_is_refused(bpe_merged_digits):
    with pytest.raises(TokenizerError, match="merges digits"):
        DigitVocab.from_hf(bpe_merged_digits)


def test_hf_forms_agree_and_share_a_fingerprint(bpe_split_digits, tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "tokenizer.json"
    bpe_split_digits.save(str(path))
    from_object = DigitVocab.from_hf(bpe_split_digits)
    from_file = DigitVocab.from_hf(path)
    from_dir = DigitVocab.from_hf(tmp_path)
    from_transformers = DigitVocab.from_hf(
        PreTrainedTokenizerFast(tokenizer_object=bpe_split_digits)
    )
    for other in (from_file, from_dir, from_transformers):
        assert other.digit_ids == from_object.digit_ids
        assert other.point_ids == from_object.point_ids
        assert other.fingerprint == from_object.fingerprint


def test_fingerprint_is_stable_and_tells_tokenizers_apart(spm_split_digits, bpe_split_digits):
    first = DigitVocab.from_sentencepiece(spm_split_digits).fingerprint
    assert DigitVocab.from_sentencepiece(spm_split_digits).fingerprint == first
    assert DigitVocab.from_hf(bpe_split_digits).fingerprint != first
    renamed = copy.deepcopy(bpe_split_digits)
    renamed.add_tokens(["<extra>"])
    assert (
        DigitVocab.from_hf(renamed).fingerprint != DigitVocab.from_hf(bpe_split_digits).fingerprint
    )


def _word_level(vocab_words: list[str]) -> Tokenizer:
    vocab = {w: i for i, w in enumerate(["[UNK]", *vocab_words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    return tok


def test_several_tokens_of_one_class_are_merged():
    words = [str(k) for k in range(10)] + ["▁5", "▁7", ".", "▁."]
    tok = _word_level(words)
    vocab = DigitVocab.from_hf(tok)
    assert vocab.digit_ids[5] == (tok.token_to_id("5"), tok.token_to_id("▁5"))
    assert vocab.digit_ids[7] == (tok.token_to_id("7"), tok.token_to_id("▁7"))
    assert len(vocab.point_ids) == 2


def test_vocabulary_without_all_ten_digits_names_the_missing_ones():
    tok = _word_level([str(k) for k in range(10) if k not in (3, 7)] + ["."])
    with pytest.raises(TokenizerError, match=r"no token for digit\(s\) '3', '7'"):
        DigitVocab.from_hf(tok)


def test_explicit_ids_and_their_checks():
    vocab = DigitVocab(digit_ids=[*range(9), [9, 20]], point_ids=[10], vocab_size=32)
    table = vocab.class_table(32, torch.device("cpu"))
    assert table[9] == table[20] == 9 and table[10] == POINT_CLASS and table[11] == -1
    with pytest.raises(TokenizerError, match="ten entries"):
        DigitVocab(digit_ids=list(range(9)))
    with pytest.raises(TokenizerError, match=r"no token for digit\(s\) '4'"):
        DigitVocab(digit_ids=[0, 1, 2, 3, [], 5, 6, 7, 8, 9])
    with pytest.raises(TokenizerError, match="both '1' and '2'"):
        DigitVocab(digit_ids=[0, 1, 1, 3, 4, 5, 6, 7, 8, 9])
    with pytest.raises(TokenizerError, match="outside the vocabulary of 8"):
        DigitVocab(digit_ids=list(range(10)), vocab_size=8)


def test_missing_or_wrong_files_name_the_path(tmp_path):
    with pytest.raises(TokenizerError, match="not found: .*nope.model"):
        DigitVocab.from_sentencepiece(tmp_path / "nope.model")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="garbage.model is not a sentencepiece model"):
        DigitVocab.from_sentencepiece(garbage)
    with pytest.raises(TokenizerError, match="not found: .*tokenizer.json"):
        DigitVocab.from_hf(tmp_path)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{}")
    with pytest.raises(TokenizerError, match="bad.json is not a tokenizer.json"):
        DigitVocab.from_hf(bad_json)
