"""Digit vocabulary: which token ids are the classes '0'..'9' (and '.') of the numeric losses.

The single source of truth for digit ids. Built from a sentencepiece model, a Hugging Face
tokenizer, or explicit ids; refuses tokenizers that merge digits into multi-digit tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError

POINT_CLASS = 10  # class index of '.' in class tables; digits are 0..9
NOT_A_CLASS = -1

# Whitespace markers a tokenizer glues to the front of a word: sentencepiece's '▁',
# byte-level BPE's 'Ġ' (the byte 0x20 after GPT-2's byte-to-unicode map).
_SPACE_MARKERS = "▁Ġ "
_ASCII_DIGITS = re.compile(r"[0-9]")
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

# Numbers a digit-splitting tokenizer must cut into single digits; a merging one shows itself.
_PROBE_TEXT = (
    "0123456789 9876543210 12 345 6789 2026-11-29 3.14159 1,000,000 $42.50 x=1234567890 "
    "99 100 2048 65536 0.001 7.5% 31415926535"
)


class TokenizerError(UserError, ValueError):
    """The tokenizer cannot carry the numeric losses (missing or merged digits)."""


def _strip_space(piece: str) -> str:
    return piece.lstrip(_SPACE_MARKERS)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class DigitVocab:
    """Token ids of the ten digit classes and of '.'.

    digit_ids: ten ids, or ten sequences of ids, for '0'..'9' (several ids for one class are
    merged by log-sum-exp of their logits). point_ids: ids of '.' tokens (locate decimals).
    vocab_size: the tokenizer's true size; logit columns at or above it (vocabulary padding)
    never get probability mass. fingerprint: a stable hash of the tokenizer's id -> piece
    table, for consistency checks of data manifests and checkpoints.
    """

    def __init__(
        self,
        digit_ids: Sequence[int | Sequence[int]],
        point_ids: Iterable[int] = (),
        *,
        vocab_size: int | None = None,
        fingerprint: str | None = None,
    ) -> None:
        if len(digit_ids) != 10:
            raise TokenizerError(f"digit_ids needs ten entries for '0'..'9', got {len(digit_ids)}")
        classes = tuple(
            (int(ids),) if isinstance(ids, int) else tuple(int(i) for i in ids) for ids in digit_ids
        )
        missing = [str(k) for k, ids in enumerate(classes) if not ids]
        if missing:
            raise TokenizerError(f"no token for digit(s) {', '.join(repr(m) for m in missing)}")
        points = tuple(int(i) for i in point_ids)
        seen: dict[int, str] = {}
        for name, ids in [*((str(k), c) for k, c in enumerate(classes)), (".", points)]:
            for i in ids:
                if i < 0:
                    raise TokenizerError(f"token id {i} for {name!r} is negative")
                if vocab_size is not None and i >= vocab_size:
                    raise TokenizerError(
                        f"token id {i} for {name!r} is outside the vocabulary of {vocab_size}"
                    )
                if i in seen:
                    raise TokenizerError(f"token id {i} is given for both {seen[i]!r} and {name!r}")
                seen[i] = name
        self.digit_ids: tuple[tuple[int, ...], ...] = classes
        self.point_ids: tuple[int, ...] = points
        self.vocab_size: int | None = vocab_size
        self.fingerprint: str = fingerprint or "ids-" + _sha256(
            json.dumps({"digits": classes, "points": points, "vocab_size": vocab_size})
        )
        self._device_cache: dict[tuple[Any, ...], Any] = {}

    def __repr__(self) -> str:
        return (
            f"DigitVocab(digit_ids={[list(c) for c in self.digit_ids]}, "
            f"point_ids={list(self.point_ids)}, vocab_size={self.vocab_size}, "
            f"fingerprint={self.fingerprint[:12]!r})"
        )

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_sentencepiece(cls, model: str | os.PathLike[str] | Any) -> DigitVocab:
        """From a sentencepiece model file (or a loaded SentencePieceProcessor)."""
        import sentencepiece as spm

        if isinstance(model, spm.SentencePieceProcessor):
            sp = model
        else:
            path = Path(model)
            if not path.is_file():
                raise TokenizerError(f"sentencepiece model not found: {path}")
            sp = spm.SentencePieceProcessor()
            try:
                sp.load(str(path))
            except (OSError, RuntimeError) as err:
                raise TokenizerError(f"{path} is not a sentencepiece model: {err}") from None
        size = sp.get_piece_size()
        pieces = [sp.id_to_piece(i) for i in range(size)]
        usable = [not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i)) for i in range(size)]

        def encode(text: str) -> list[str]:
            return sp.encode(text, out_type=str)

        return cls._from_pieces(pieces, usable, encode)

    @classmethod
    def from_hf(cls, tokenizer: Any) -> DigitVocab:
        """From a Hugging Face tokenizer: a transformers tokenizer object, a
        `tokenizers.Tokenizer`, a `tokenizer.json` path, or a local tokenizer directory."""
        backend = _hf_backend(tokenizer)
        size = backend.get_vocab_size(with_added_tokens=True)
        vocab = backend.get_vocab(with_added_tokens=True)
        pieces = [""] * size
        for piece, i in vocab.items():
            if i < size:
                pieces[i] = piece
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        usable = [i not in special and not _BYTE_PIECE.match(p) for i, p in enumerate(pieces)]

        def encode(text: str) -> list[str]:
            return backend.encode(text, add_special_tokens=False).tokens

        return cls._from_pieces(pieces, usable, encode)

    @classmethod
    def _from_pieces(
        cls,
        pieces: list[str],
        usable: list[bool],
        encode: Callable[[str], list[str]],
    ) -> DigitVocab:
        merged = sorted(
            p
            for p in set(encode(_PROBE_TEXT))
            if len(_ASCII_DIGITS.findall(p)) >= 2 and not _BYTE_PIECE.match(p)
        )
        if merged:
            examples = ", ".join(repr(p) for p in merged[:5])
            raise TokenizerError(
                f"tokenizer merges digits into multi-digit tokens (e.g. {examples}); the numeric "
                "losses need one token per digit (sentencepiece split_digits, or a \\p{N} "
                "pre-tokenizer that splits single digits)"
            )
        digits: list[list[int]] = [[] for _ in range(10)]
        points: list[int] = []
        for i, piece in enumerate(pieces):
            if not usable[i]:
                continue
            text = _strip_space(piece)
            if len(text) == 1 and "0" <= text <= "9":
                digits[int(text)].append(i)
            elif text == ".":
                points.append(i)
        missing = [str(k) for k in range(10) if not digits[k]]
        if missing:
            raise TokenizerError(
                f"tokenizer has no token for digit(s) {', '.join(repr(m) for m in missing)}; "
                "the numeric losses need all ten digits as tokens"
            )
        fingerprint = "vocab-" + _sha256("\n".join(pieces))
        return cls(digits, points, vocab_size=len(pieces), fingerprint=fingerprint)

    # ---- tensors for the losses ---------------------------------------------------------

    @cached_property
    def max_id(self) -> int:
        return max(max(max(c) for c in self.digit_ids), max(self.point_ids, default=-1))

    def class_table(self, size: int, device: torch.device) -> torch.Tensor:
        """[size] long: the class of each token id (0..9, POINT_CLASS) or NOT_A_CLASS."""
        key = ("table", size, device)
        if key not in self._device_cache:
            table = torch.full((max(size, self.max_id + 1),), NOT_A_CLASS, dtype=torch.long)
            for k, ids in enumerate(self.digit_ids):
                table[list(ids)] = k
            if self.point_ids:
                table[list(self.point_ids)] = POINT_CLASS
            # non_blocking: from pageable memory CUDA stages the copy at once and the host
            # does not wait for the device (a blocking copy would, at the first micro-batch)
            self._device_cache[key] = table.to(device, non_blocking=True)
        return self._device_cache[key]

    def class_members(
        self, num_classes: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Member ids of each class, padded: ids [K, M] long and valid [K, M] bool.

        Padding repeats the class's first id with valid=False, so scatters stay in range.
        """
        if num_classes == 11 and not self.point_ids:
            raise TokenizerError("include_decimal_point=True but the tokenizer has no '.' token")
        key = ("members", num_classes, device)
        if key not in self._device_cache:
            classes = [*self.digit_ids, self.point_ids][:num_classes]
            width = max(len(c) for c in classes)
            ids = torch.tensor([list(c) + [c[0]] * (width - len(c)) for c in classes])
            valid = torch.tensor([[j < len(c) for j in range(width)] for c in classes])
            self._device_cache[key] = (
                ids.to(device, non_blocking=True),  # as the class table
                valid.to(device, non_blocking=True),
            )
        return self._device_cache[key]


def _hf_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind any accepted Hugging Face tokenizer form."""
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"Hugging Face tokenizer not found: {path}")
        try:
            return tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{path} is not a tokenizer.json file: {err}") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerError(
            f"{type(tokenizer).__name__} has no fast (tokenizers) backend; pass a "
            "tokenizer.json path or use DigitVocab.from_sentencepiece for a .model file"
        )
    return backend
