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


# ---- grouped digits (number tokens of 1..m digits) ---------------------------------------


def test_llama3_pattern_bpe_is_grouped_with_every_string(synth_llama3_tokenizer):
    tok = Tokenizer.from_file(str(synth_llama3_tokenizer))
    vocab = DigitVocab.from_hf(synth_llama3_tokenizer)
    assert vocab.max_digits == 3 and vocab.grouped and vocab.missing_strings == ()
    assert "up to m=3" in vocab.describe() and "1100 of 1100" in vocab.describe()
    assert vocab.numbers["123"] == (tok.token_to_id("123"),)
    assert vocab.digit_ids[7] == (tok.token_to_id("7"),)
    ids, valid = vocab.class_members(10, torch.device("cpu"))  # each number token, once
    assert ids.shape == (1110, 1) and bool(valid.all()) and len(set(ids.flatten().tolist())) == 1110
    members, valid = vocab.slot_sets(torch.device("cpu"))
    assert members.shape[0] == 10 * (1 + 2 + 3) and int(valid.sum()) == 10 + 2 * 100 + 3 * 1000
    # the set (k=3, slot 1, digit 2): the hundred 3-digit tokens with a '2' in the middle
    row = 10 * (3 + 1) + 2
    members = {tok.id_to_token(vocab.number_ids[int(i)]) for i in members[row][valid[row]]}
    assert members == {f"{a}2{b}" for a in range(10) for b in range(10)}
    count, digits = vocab.number_table(vocab.vocab_size, torch.device("cpu"))
    assert count[tok.token_to_id("045")] == 3 and digits[tok.token_to_id("045")].tolist() == [
        0,
        4,
        5,
    ]


def test_space_marked_number_pieces_join_their_string():
    """Byte-level pieces such as 'Ġ12' (a split that keeps the space) are the string '12'."""
    from data_tools.tokenizer_train import train_grouped_bpe

    from ..conftest import number_corpus

    tok = train_grouped_bpe(number_corpus(300), 1700, pattern=r" ?\p{N}{1,3}|[^\s\p{N}]+|\s+")
    vocab = DigitVocab.from_hf(tok)
    assert vocab.max_digits == 3
    spaced = tok.token_to_id("Ġ123")
    assert spaced is not None and spaced in vocab.numbers["123"]
    both = [s for s, ids in vocab.numbers.items() if len(ids) == 2]
    assert both and all(
        {tok.id_to_token(i).lstrip("Ġ") for i in vocab.numbers[s]} == {s} for s in both
    )


def test_unbounded_digit_runs_are_refused_naming_a_token(bpe_merged_digits):
    with pytest.raises(TokenizerError, match=r"merges digits into runs longer than 3") as err:
        DigitVocab.from_hf(bpe_merged_digits)
    message = str(err.value)
    assert "\n" not in message
    example = message.split("e.g. ")[1].split(",")[0].strip("'")
    assert bpe_merged_digits.token_to_id(example) is not None
    assert sum(c.isdigit() for c in example) > 3


def _tiktoken_file(path, pieces):
    import base64

    lines = [f"{base64.b64encode(p.encode()).decode()} {rank}" for rank, p in enumerate(pieces)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tiktoken_file_is_read_from_its_pieces(tmp_path):
    numbers = [f"{n:0{k}d}" for k in (1, 2, 3) for n in range(10**k)]
    pieces = ["a", "b", " the", ".", *numbers, " ."]
    path = _tiktoken_file(tmp_path / "tokenizer.model", pieces)
    vocab = DigitVocab.from_tiktoken(path, vocab_size=len(pieces) + 256)
    assert vocab.vocab_size == len(pieces) + 256 and vocab.max_digits == 3
    assert vocab.numbers["042"] == (pieces.index("042"),)
    assert vocab.point_ids == (3, len(pieces) - 1)
    assert vocab.missing_strings == ()


def test_tiktoken_digits_merged_with_letters_are_refused(tmp_path):
    path = _tiktoken_file(tmp_path / "t.model", [str(d) for d in range(10)] + ["12", "a1"])
    with pytest.raises(
        TokenizerError, match=r"merges digits with other characters \(e\.g\. 'a1'\)"
    ):
        DigitVocab.from_tiktoken(path)


def test_tiktoken_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "t.model"
    path.write_text("MA== 0\nnot base64!\n")
    with pytest.raises(TokenizerError, match=r"t.model: line 2 is not"):
        DigitVocab.from_tiktoken(path)


def test_grouped_explicit_ids_are_checked():
    with pytest.raises(TokenizerError, match=r"runs longer than 3 \(e\.g\. '1234'"):
        DigitVocab(list(range(10)), numbers={"1234": [20]})
    with pytest.raises(TokenizerError, match=r"no 2-digit number token has digit '0' at place 0"):
        DigitVocab(list(range(10)), numbers={"12": [20]})
    with pytest.raises(TokenizerError, match="both '3' and '03'"):
        DigitVocab(
            list(range(10)), numbers={f"{n:02d}": [n if n == 3 else 100 + n] for n in range(100)}
        )
    grouped = DigitVocab(list(range(10)), numbers={f"{n:02d}": [100 + n] for n in range(100)})
    assert grouped.max_digits == 2 and grouped.missing_strings == ()
    assert grouped.fingerprint != DigitVocab(list(range(10))).fingerprint
    with pytest.raises(
        TokenizerError, match="include_decimal_point=True needs a tokenizer with one"
    ):
        grouped.class_members(11, torch.device("cpu"))
