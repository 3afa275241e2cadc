"""`digit_vocab_of` (models/megatron_tokenizer.py) on the tokenizers a Megatron-LM run builds:
megatron-core 0.17+'s own (`megatron.core.tokenizers`, built by megatron.training's
`build_tokenizer` from its parsed arguments: .venv312), core_v0.16.x's legacy classes (not in
any wheel: stand-ins holding what `megatron/training/tokenizer/tokenizer.py` at core_v0.16.1
holds, in the attributes it holds them), paths, and the one-line refusals. Each vocabulary is
checked against the run's own ids: what the Megatron tokenizer gives for each digit."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from del_megatron import DigitVocab, TokenizerError
from del_megatron.models.megatron_tokenizer import digit_vocab_of

pytestmark = pytest.mark.megatron

needs_megatron_training = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="megatron.training ships with megatron-core 0.17+ (.venv312)",
)


@pytest.fixture(scope="module")
def hf_dir(synth_llama3_tokenizer, tmp_path_factory):
    """A Hugging Face tokenizer directory (what --tokenizer-model names for
    HuggingFaceTokenizer): Llama-3's digit grouping."""
    out = tmp_path_factory.mktemp("hf")
    shutil.copy(synth_llama3_tokenizer, out / "tokenizer.json")
    return out


def assert_same_vocab(vocab: DigitVocab, expected: DigitVocab) -> None:
    assert vocab.digit_ids == expected.digit_ids
    assert vocab.point_ids == expected.point_ids
    assert vocab.numbers == expected.numbers
    assert vocab.fingerprint == expected.fingerprint


def assert_run_ids(vocab: DigitVocab, tokenize) -> None:
    """Each digit's class holds the id the run's tokenizer gives that digit, alone."""
    for digit in range(10):
        ids = [i for i in tokenize(f"x{digit}") if i in vocab.digit_ids[digit]]
        assert ids, (digit, tokenize(f"x{digit}"), vocab.digit_ids[digit])


def megatron_tokenizer(monkeypatch, *argv: str):
    """megatron.training's tokenizer as `initialize_megatron` builds it: its arguments parsed
    by its own parser (from sys.argv), then `build_tokenizer` (megatron.core.tokenizers since
    0.17)."""
    from megatron.training.arguments import parse_args
    from megatron.training.global_vars import build_tokenizer

    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
    args = parse_args()
    args.rank = 0
    return build_tokenizer(args)


# ---- megatron-core 0.17+: megatron.core.tokenizers, as megatron.training builds them ----


@needs_megatron_training
@pytest.mark.parametrize(
    "tokenizer_type", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"]
)
def test_megatron_sentencepiece_tokenizers(tokenizer_type, synth_tokenizer, monkeypatch):
    tokenizer = megatron_tokenizer(
        monkeypatch, "--tokenizer-type", tokenizer_type, "--tokenizer-model", str(synth_tokenizer)
    )
    vocab = digit_vocab_of(tokenizer)
    assert_same_vocab(vocab, DigitVocab.from_sentencepiece(synth_tokenizer))
    assert_run_ids(vocab, tokenizer.tokenize)


@needs_megatron_training
def test_megatron_hugging_face_tokenizer_llama3_grouping(
    hf_dir, synth_llama3_tokenizer, monkeypatch
):
    tokenizer = megatron_tokenizer(
        monkeypatch, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)
    )
    vocab = digit_vocab_of(tokenizer)
    assert vocab.grouped and vocab.max_digits == 3  # Llama-3's \p{N}{1,3}
    assert_same_vocab(vocab, DigitVocab.from_hf(synth_llama3_tokenizer))
    assert_run_ids(vocab, tokenizer.tokenize)


@needs_megatron_training
def test_megatron_null_tokenizer_is_refused_in_one_line(monkeypatch):
    tokenizer = megatron_tokenizer(
        monkeypatch, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"
    )
    with pytest.raises(TokenizerError, match="no sentencepiece or Hugging Face tokenizer") as err:
        digit_vocab_of(tokenizer)
    assert "\n" not in str(err.value)


# ---- core_v0.16.x: megatron/training/tokenizer/tokenizer.py's legacy classes ----


class LegacySentencePieceTokenizer:
    """core_v0.16.1's _SentencePieceTokenizer (and _GPTSentencePieceTokenizer,
    _Llama2Tokenizer, its subclasses): the processor in `tokenizer`."""

    def __init__(self, model_file):
        import sentencepiece

        self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(model_file))

    def tokenize(self, text):
        return self.tokenizer.encode_as_ids(text)


class LegacyHuggingFaceTokenizer:
    """core_v0.16.1's _HuggingFaceTokenizer: transformers.AutoTokenizer in `_tokenizer`, and
    its vocabulary copied to `_vocab`."""

    def __init__(self, pretrained_model_name_or_path):
        import transformers

        self._tokenizer = transformers.AutoTokenizer.from_pretrained(
            pretrained_model_name_or_path=str(pretrained_model_name_or_path)
        )
        self._vocab = self._tokenizer.get_vocab()

    def tokenize(self, text):
        return self._tokenizer(text).input_ids


def test_legacy_sentencepiece_tokenizer(synth_tokenizer):
    tokenizer = LegacySentencePieceTokenizer(synth_tokenizer)
    vocab = digit_vocab_of(tokenizer)
    assert_same_vocab(vocab, DigitVocab.from_sentencepiece(synth_tokenizer))
    assert_run_ids(vocab, tokenizer.tokenize)


def test_legacy_hugging_face_tokenizer(hf_dir, synth_llama3_tokenizer):
    tokenizer = LegacyHuggingFaceTokenizer(hf_dir)
    vocab = digit_vocab_of(tokenizer)
    assert_same_vocab(vocab, DigitVocab.from_hf(synth_llama3_tokenizer))
    assert_run_ids(vocab, tokenizer.tokenize)


# ---- paths, library objects, refusals ----


def test_paths_are_read_by_the_package_tokenizer(synth_tokenizer, synth_llama3_tokenizer, hf_dir):
    assert_same_vocab(
        digit_vocab_of(synth_tokenizer), DigitVocab.from_sentencepiece(synth_tokenizer)
    )
    for path in (synth_llama3_tokenizer, hf_dir, str(hf_dir)):
        assert_same_vocab(digit_vocab_of(path), DigitVocab.from_hf(synth_llama3_tokenizer))


def test_library_objects_themselves(synth_tokenizer, synth_llama3_tokenizer):
    import sentencepiece
    import tokenizers

    sp = sentencepiece.SentencePieceProcessor(model_file=str(synth_tokenizer))
    assert_same_vocab(digit_vocab_of(sp), DigitVocab.from_sentencepiece(synth_tokenizer))
    hf = tokenizers.Tokenizer.from_file(str(synth_llama3_tokenizer))
    assert_same_vocab(digit_vocab_of(hf), DigitVocab.from_hf(synth_llama3_tokenizer))


def test_a_tokenizer_that_merges_digits_is_refused(spm_merged_digits):
    with pytest.raises(TokenizerError):
        digit_vocab_of(LegacySentencePieceTokenizer(spm_merged_digits))


def test_tiktoken_is_refused_in_one_line():
    tiktoken = pytest.importorskip("tiktoken")

    class LegacyTikTokenizer:  # core_v0.16.1's CustomTikTokenizer: the Encoding in `_model`
        def __init__(self):
            self._model = tiktoken.Encoding(
                name="t", pat_str=r"\d", mergeable_ranks={b"0": 0}, special_tokens={}
            )

    with pytest.raises(TokenizerError, match="TikTokenizer numbers its special tokens") as err:
        digit_vocab_of(LegacyTikTokenizer())
    assert "\n" not in str(err.value)


def test_an_unknown_object_is_refused_in_one_line():
    class GPT2Like:  # core_v0.16.1's _GPT2BPETokenizer: megatron's own BPE in `tokenizer`
        def __init__(self):
            self.tokenizer = object()

    with pytest.raises(TokenizerError, match="GPT2Like") as err:
        digit_vocab_of(GPT2Like())
    assert "\n" not in str(err.value)
