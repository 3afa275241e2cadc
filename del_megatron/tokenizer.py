"""One tokenizer interface over sentencepiece models and Hugging Face tokenizers.

Used to build shards (data_tools) and to decode and evaluate (training); the digit classes
and the fingerprint come from `DigitVocab`, the single source of truth for both.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from .losses import DigitVocab
from .losses.vocab import TokenizerError


class Tokenizer:
    """encode(text) -> ids (no BOS/EOS added), decode(ids), eos_id, vocab_size, digit_vocab."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TokenizerError(f"tokenizer not found: {self.path}")
        if self.path.suffix == ".model":
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor()
            try:
                self._sp.load(str(self.path))
            except (OSError, RuntimeError) as err:
                raise TokenizerError(f"{self.path} is not a sentencepiece model: {err}") from None
            self._hf = None
        else:
            from .losses.vocab import _hf_backend

            self._sp = None
            self._hf = _hf_backend(self.path)

    @cached_property
    def digit_vocab(self) -> DigitVocab:
        if self._sp is not None:
            return DigitVocab.from_sentencepiece(self._sp)
        return DigitVocab.from_hf(self._hf)

    @property
    def fingerprint(self) -> str:
        return self.digit_vocab.fingerprint

    @property
    def vocab_size(self) -> int:
        if self._sp is not None:
            return self._sp.get_piece_size()
        return self._hf.get_vocab_size(with_added_tokens=True)

    @cached_property
    def eos_id(self) -> int:
        if self._sp is not None:
            eos = self._sp.eos_id()
            if eos < 0:
                raise TokenizerError(f"{self.path}: sentencepiece model has no EOS token")
            return eos
        for name in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<｜end▁of▁sentence｜>"):
            token_id = self._hf.token_to_id(name)
            if token_id is not None:
                return token_id
        raise TokenizerError(f"{self.path}: no end-of-text token found")

    def encode(self, text: str) -> list[int]:
        if self._sp is not None:
            return self._sp.encode(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self._sp is not None:
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=False)
