"""The digit vocabulary of the tokenizer a Megatron-LM run built, whatever its type.

`digit_vocab_of(megatron.training.get_tokenizer())` reads the tokenizer library object inside
Megatron's wrapper and builds the `DigitVocab` from it, so the ids are the run's own:

* megatron-core 0.17+ (`megatron.core.tokenizers`): the wrapper's `_tokenizer` is the library
  tokenizer, whose `tokenizer` is a `sentencepiece.SentencePieceProcessor`
  (`--tokenizer-type SentencePieceTokenizer`, `GPTSentencePieceTokenizer`, `Llama2Tokenizer`)
  or a transformers tokenizer (`HuggingFaceTokenizer`: the Llama-3 family, Qwen, ...);
* Megatron-LM core_v0.16.x (`megatron/training/tokenizer/tokenizer.py`): `_SentencePieceTokenizer`
  and its kin keep the processor in `tokenizer`, `_HuggingFaceTokenizer` the transformers
  tokenizer in `_tokenizer`.

A path (a sentencepiece `.model`, a `tokenizer.json` or its directory) is read by the
package's own `Tokenizer`. Megatron's `TikTokenizer` numbers its special tokens first and
shifts every rank by their count, which `DigitVocab.from_tiktoken` (special tokens last, as
Llama-3's file) does not: refused, as is a tokenizer with no vocabulary (`NullTokenizer`).
Nothing of megatron is imported; the objects are read by what they hold.
"""

from __future__ import annotations

import os
from typing import Any

from ..losses import DigitVocab, TokenizerError

# where Megatron's wrappers keep the object they wrap: megatron.core.tokenizers' text tokenizer
# (`_tokenizer`) and its library classes (`tokenizer`); core_v0.16.x's legacy classes
# (`tokenizer`, `_tokenizer`; CustomTikTokenizer's `_model`); transformers' slow
# sentencepiece tokenizers (`sp_model`)
_INNER = ("_tokenizer", "tokenizer", "sp_model", "_model")
_DEPTH = 4  # wrapper -> library class -> transformers tokenizer -> its backend


def digit_vocab_of(tokenizer: Any) -> DigitVocab:
    """The digit vocabulary of `tokenizer`: Megatron-LM's built tokenizer
    (`megatron.training.get_tokenizer()`, either generation), a library tokenizer (a
    SentencePieceProcessor, a transformers or `tokenizers` tokenizer), or a path a
    `del_megatron.tokenizer.Tokenizer` reads. Raises TokenizerError (one line) when none is
    found or the tokenizer cannot carry the numeric losses."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from ..tokenizer import Tokenizer

        return Tokenizer(tokenizer).digit_vocab
    found = _library_tokenizer(tokenizer)
    if found is None:
        raise TokenizerError(
            f"no sentencepiece or Hugging Face tokenizer found in {_describe(tokenizer)}: "
            "the numeric losses read digit ids from --tokenizer-type SentencePieceTokenizer, "
            "GPTSentencePieceTokenizer, Llama2Tokenizer or HuggingFaceTokenizer (or pass a "
            "DigitVocab of your own)"
        )
    kind, inner = found
    if kind == "sentencepiece":
        return DigitVocab.from_sentencepiece(inner)
    if kind == "hf":
        return DigitVocab.from_hf(inner)
    raise TokenizerError(
        f"{_describe(tokenizer)} is a tiktoken tokenizer: Megatron's TikTokenizer numbers its "
        "special tokens first, which DigitVocab.from_tiktoken does not; use the model's "
        "tokenizer.json with --tokenizer-type HuggingFaceTokenizer"
    )


def _library_tokenizer(root: Any) -> tuple[str, Any] | None:
    """('sentencepiece' | 'hf' | 'tiktoken', the object), the first found breadth-first
    through the wrappers' attributes, or None."""
    level, seen = [root], set()
    for _ in range(_DEPTH):
        following = []
        for obj in level:
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            kind = _kind(obj)
            if kind is not None:
                return kind, obj
            following.extend(_attribute(obj, name) for name in _INNER)
        level = following
    return None


def _kind(obj: Any) -> str | None:
    module = type(obj).__module__ or ""
    if module.startswith("sentencepiece"):
        return "sentencepiece"
    if module.startswith("tokenizers") or getattr(obj, "backend_tokenizer", None) is not None:
        return "hf"
    if module.startswith("tiktoken"):
        return "tiktoken"
    return None


def _attribute(obj: Any, name: str) -> Any:
    """obj.name when the instance holds it, else None (a property is not called: a wrapper's
    may raise when it has nothing to give)."""
    return getattr(obj, "__dict__", {}).get(name)


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
