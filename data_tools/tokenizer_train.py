"""Train a tokenizer suited to numbers: a sentencepiece model with digits split, byte fallback
and identity normalization (the text's digits and spacing reach the model as written), or a
byte-level BPE `tokenizer.json` with Llama-3's pre-tokenizer, which groups digits into tokens
of 1..3 (`\\p{N}{1,3}`; the numeric losses' grouped digits, docs/losses.md)."""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Literal

from del_megatron.errors import one_line
from del_megatron.losses import DigitVocab

from .readers import Fields, InputError, expand_inputs, read_records


def train_tokenizer(
    inputs: list[Path],
    out_path: Path,
    *,
    vocab_size: int = 4000,
    fields: Fields | None = None,
    max_sentences: int = 200_000,
    style: Literal["sentencepiece", "llama3"] = "sentencepiece",
) -> Path:
    """Write a tokenizer trained on the inputs' text; returns its path. style: a sentencepiece
    .model that splits digits, or (`llama3`) a byte-level BPE tokenizer.json grouping them."""
    fields = fields or Fields()
    files = expand_inputs(inputs)  # refused here, before sentencepiece starts
    sentences_seen = 0

    def sentences():
        nonlocal sentences_seen
        for path in files:
            for record in read_records(path, fields):
                text = record if isinstance(record, str) else record[0] + "\n" + record[1]
                for line in text.splitlines():
                    if line.strip():
                        yield line
                        sentences_seen += 1
                        if sentences_seen >= max_sentences:
                            return

    if style == "llama3":
        data = _train_llama3_bpe(sentences, vocab_size)
    else:
        data = _train_sentencepiece(sentences, vocab_size)
    if sentences_seen == 0:
        raise InputError(f"no text to train on in {', '.join(map(str, inputs))}")
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(out_path)
    except OSError as err:
        raise InputError(f"{out_path}: cannot write ({err.strerror or err})") from None
    return out_path


def _train_sentencepiece(sentences, vocab_size: int) -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    lines = iter(sentences())
    first = next(lines, None)
    if first is None:  # nothing to train on: the caller names the inputs
        return b""
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=itertools.chain([first], lines),
            model_writer=model,
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            model_type="bpe",
            split_digits=True,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            bos_id=1,
            eos_id=2,
            unk_id=0,
            pad_id=-1,
            num_threads=1,  # deterministic
            minloglevel=2,
        )
    except RuntimeError as err:  # sentencepiece reports every training failure so
        raise InputError(f"cannot train a tokenizer: {one_line(err)}") from None
    return model.getvalue()


# Llama-3's pre-tokenizer split (its tokenizer.json): digits in chunks of 1..3, never glued
# to a space or a letter.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Every digit string of 1..3 digits is made a token: the text is followed by this many
# copies of each, so BPE learns all 1110 (a grouped vocabulary with none missing).
_NUMBER_PRIMER_COPIES = 1024


def grouped_pre_tokenizer(pattern: str = LLAMA3_PATTERN):
    """A regex split (Llama-3's by default) followed by the byte-level alphabet map."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _train_llama3_bpe(sentences, vocab_size: int) -> bytes:
    lines = iter(sentences())
    first = next(lines, None)
    if first is None:
        return b""
    tokenizer = train_grouped_bpe(itertools.chain([first], lines), vocab_size)
    return tokenizer.to_str().encode("utf-8")


def train_grouped_bpe(lines, vocab_size: int, pattern: str = LLAMA3_PATTERN):
    """A byte-level BPE `tokenizers.Tokenizer` on the text `lines`, split by `pattern`, with
    every 1..3-digit string a token (InputError when vocab_size cannot hold them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    numbers = [f"{n:0{k}d}" for k in (1, 2, 3) for n in range(10**k)]
    primer = [" ".join(numbers)] * _NUMBER_PRIMER_COPIES
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = grouped_pre_tokenizer(pattern)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(numbers) + 2),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(itertools.chain(lines, primer), trainer)
    missing = DigitVocab.from_hf(tokenizer).missing_strings
    if missing:
        raise InputError(
            f"--vocab-size {vocab_size} leaves {len(missing)} of the {len(numbers) - 10} digit "
            f"strings of 2..3 digits out (e.g. {missing[0]!r}); raise it"
        )
    return tokenizer
