"""Digit vocabulary: which token ids are the classes '0'..'9' (and '.') of the numeric losses,
and, for tokenizers that group digits (Llama-3's `\\p{N}{1,3}`), which ids are the number tokens
of 2..m digits.

The single source of truth for digit ids. Built from a sentencepiece model, a Hugging Face
tokenizer, a tiktoken BPE file, or explicit ids; refuses tokenizers that merge digits with
other characters or into runs longer than `MAX_GROUP_DIGITS` (an unbounded `\\d+` pattern).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
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
_NUMBER = re.compile(r"^[0-9]+$")

# The longest number token carried: Llama-3, OLMo-2, GPT-4 and DeepSeek-V3 cut digit runs into
# chunks of 1..3 (`\p{N}{1,3}`). A longer number piece means runs are not cut at a fixed width
# (`\d+`): places, the groups (10**m strings) and the member tables would grow without bound.
MAX_GROUP_DIGITS = 3

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
        numbers: Mapping[str, Sequence[int]] | None = None,
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
        grouped = _check_numbers(numbers or {})
        seen: dict[int, str] = {}
        named = [*((str(k), c) for k, c in enumerate(classes)), (".", points), *grouped.items()]
        for name, ids in named:
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
        self.numbers: dict[str, tuple[int, ...]] = grouped
        """Number tokens of 2..m digits: digit string -> ids (every piece of that string)."""
        _check_no_empty_set(grouped)
        described = {"digits": classes, "points": points, "vocab_size": vocab_size}
        if grouped:  # absent for single-digit vocabularies: their fingerprints stay as they were
            described["numbers"] = sorted(grouped.items())
        self.fingerprint: str = fingerprint or "ids-" + _sha256(json.dumps(described))
        self._device_cache: dict[tuple[Any, ...], Any] = {}

    def __repr__(self) -> str:
        return (
            f"DigitVocab(digit_ids={[list(c) for c in self.digit_ids]}, "
            f"point_ids={list(self.point_ids)}, vocab_size={self.vocab_size}, "
            f"max_digits={self.max_digits}, fingerprint={self.fingerprint[:12]!r})"
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
    def from_tiktoken(
        cls, path: str | os.PathLike[str], *, vocab_size: int | None = None
    ) -> DigitVocab:
        """From a tiktoken BPE file (Llama-3's original `tokenizer.model`: one line
        `<base64 bytes> <rank>` per token). Ranks are the ids; ids from the file's size up to
        `vocab_size` are special tokens (Llama-3: 128000 ranks, 256 special, 128256). Without an
        encoder, grouping is read from the pieces alone (`_classify_pieces`)."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tiktoken BPE file not found: {path}")
        ranks: dict[int, bytes] = {}
        with path.open("rb") as handle:
            for line_number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    token, rank = line.split()
                    ranks[int(rank)] = base64.b64decode(token, validate=True)
                except (ValueError, binascii.Error):
                    raise TokenizerError(
                        f"{path}: line {line_number} is not '<base64> <rank>': {line[:60]!r}"
                    ) from None
        size = max(ranks, default=-1) + 1
        if vocab_size is not None and vocab_size < size:
            raise TokenizerError(f"{path} has {size} ranks, more than vocab_size={vocab_size}")
        size = vocab_size or size
        pieces = [""] * size
        usable = [False] * size
        for rank, raw in ranks.items():
            try:
                pieces[rank], usable[rank] = raw.decode("utf-8"), True
            except UnicodeDecodeError:  # a partial UTF-8 sequence: never a digit
                pieces[rank] = raw.hex()
        return cls._from_pieces(pieces, usable, None)

    @classmethod
    def _from_pieces(
        cls,
        pieces: list[str],
        usable: list[bool],
        encode: Callable[[str], list[str]] | None,
    ) -> DigitVocab:
        """encode: the tokenizer on text (its pieces); a probe text shows whether it splits,
        groups or merges digits. None (a bare tiktoken file): the pieces alone decide."""
        if encode is None:
            probe = [p for p, ok in zip(pieces, usable, strict=True) if ok]
        else:
            probe = [p for p in set(encode(_PROBE_TEXT)) if not _BYTE_PIECE.match(p)]
        grouped = _classify_pieces(probe, pieces, usable)
        digits: list[list[int]] = [[] for _ in range(10)]
        points: list[int] = []
        numbers: dict[str, list[int]] = {}
        for i, piece in enumerate(pieces):
            if not usable[i]:
                continue
            text = _strip_space(piece)
            if len(text) == 1 and "0" <= text <= "9":
                digits[int(text)].append(i)
            elif text == ".":
                points.append(i)
            elif grouped and _NUMBER.match(text):
                numbers.setdefault(text, []).append(i)
        missing = [str(k) for k in range(10) if not digits[k]]
        if missing:
            raise TokenizerError(
                f"tokenizer has no token for digit(s) {', '.join(repr(m) for m in missing)}; "
                "the numeric losses need all ten digits as tokens"
            )
        fingerprint = "vocab-" + _sha256("\n".join(pieces))
        return cls(digits, points, vocab_size=len(pieces), fingerprint=fingerprint, numbers=numbers)

    # ---- grouped digits -----------------------------------------------------------------

    @cached_property
    def max_digits(self) -> int:
        """m: the most digits in one number token (1: every digit is its own token)."""
        return max((len(s) for s in self.numbers), default=1)

    @property
    def grouped(self) -> bool:
        """Whether number tokens carry several digits (the slot marginals of losses/groups.py)."""
        return self.max_digits > 1

    @cached_property
    def missing_strings(self) -> tuple[str, ...]:
        """Digit strings of 2..m digits that are no token: absent from their groups G_k."""
        return tuple(
            "".join(chars)
            for k in range(2, self.max_digits + 1)
            for chars in itertools.product("0123456789", repeat=k)
            if "".join(chars) not in self.numbers
        )

    def describe(self) -> str:
        """One line on how the tokenizer writes numbers, for logs."""
        if not self.grouped:
            return "digits: one token per digit"
        total = sum(10**k for k in range(2, self.max_digits + 1))
        missing = self.missing_strings
        line = (
            f"digits: grouped, up to m={self.max_digits} per token; "
            f"{total - len(missing)} of {total} strings of 2..{self.max_digits} digits are tokens"
        )
        if missing:
            line += f" (missing e.g. {', '.join(repr(x) for x in missing[:5])})"
        return line

    def group_sets(self) -> list[tuple[int, ...]]:
        """The member ids of every (k, j, d) set, in the order of `groups.slot_offset`: for
        k = 1..m, slot j = 0..k-1, digit d = 0..9, the ids of k-digit number tokens whose
        digit j is d. k = 1 are the ten digit classes themselves."""
        sets: list[tuple[int, ...]] = []
        for k in range(1, self.max_digits + 1):
            strings = (
                {str(d): ids for d, ids in enumerate(self.digit_ids)}
                if k == 1
                else {s: ids for s, ids in self.numbers.items() if len(s) == k}
            )
            for j in range(k):
                for d in "0123456789":
                    sets.append(
                        tuple(i for s, ids in sorted(strings.items()) if s[j] == d for i in ids)
                    )
        return sets

    @cached_property
    def number_ids(self) -> tuple[int, ...]:
        """Every number token's id, each once (U = 10 + .. single digits and multi-digit)."""
        return tuple(sorted({i for ids in (*self.digit_ids, *self.numbers.values()) for i in ids}))

    def slot_sets(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (k, j, d) sets of `group_sets` as positions in `number_ids`, padded:
        members [S, W] long and valid [S, W] bool (padding repeats a set's first member)."""
        key = ("sets", device)
        if key not in self._device_cache:
            position = {i: n for n, i in enumerate(self.number_ids)}
            sets = [[position[i] for i in c] for c in self.group_sets()]
            width = max(len(c) for c in sets)
            members = torch.tensor([c + [c[0]] * (width - len(c)) for c in sets])
            valid = torch.tensor([[j < len(c) for j in range(width)] for c in sets])
            self._device_cache[key] = (members.to(device), valid.to(device))
        return self._device_cache[key]

    def number_table(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token id: its number of digits [size] long (0: not a number token) and its
        digits [size, m] long (0 past its length)."""
        key = ("numbers", size, device)
        if key not in self._device_cache:
            length = max(size, self.max_id + 1)
            count = torch.zeros(length, dtype=torch.long)
            digits = torch.zeros(length, self.max_digits, dtype=torch.long)
            strings = [
                *((str(d), ids) for d, ids in enumerate(self.digit_ids)),
                *self.numbers.items(),
            ]
            for text, ids in strings:
                count[list(ids)] = len(text)
                digits[list(ids), : len(text)] = torch.tensor([int(c) for c in text])
            self._device_cache[key] = (count.to(device), digits.to(device))
        return self._device_cache[key]

    # ---- tensors for the losses ---------------------------------------------------------

    @cached_property
    def max_id(self) -> int:
        numbers = (max(ids) for ids in self.numbers.values())
        return max(max(max(c) for c in self.digit_ids), max(self.point_ids, default=-1), *numbers)

    def class_table(self, size: int, device: torch.device) -> torch.Tensor:
        """[size] long: the class of each token id (0..9, POINT_CLASS) or NOT_A_CLASS."""
        key = ("table", size, device)
        if key not in self._device_cache:
            table = torch.full((max(size, self.max_id + 1),), NOT_A_CLASS, dtype=torch.long)
            for k, ids in enumerate(self.digit_ids):
                table[list(ids)] = k
            if self.point_ids:
                table[list(self.point_ids)] = POINT_CLASS
            self._device_cache[key] = table.to(device)
        return self._device_cache[key]

    def class_members(
        self, num_classes: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Member ids of each class, padded: ids [K, M] long and valid [K, M] bool.

        Padding repeats the class's first id with valid=False, so scatters stay in range.
        For a grouped vocabulary each number token is a class of its own (`number_ids`,
        [U, 1]): the ops hand over its raw logit, exact on every rank and each token once
        (1110 for Llama-3, not the 6000 entries of the 60 digit-slot sets), and the sets'
        log-sum-exps are formed from them at the digit slots only (`groups.slot_class_logits`).
        """
        if num_classes == 11 and self.grouped:
            raise TokenizerError(
                "include_decimal_point=True needs a tokenizer with one token per digit: with "
                f"number tokens of up to {self.max_digits} digits '.' is no eleventh class of a "
                "digit slot; set include_decimal_point=false"
            )
        if num_classes == 11 and not self.point_ids:
            raise TokenizerError("include_decimal_point=True but the tokenizer has no '.' token")
        key = ("members", num_classes, device)
        if key not in self._device_cache:
            classes = (
                [(i,) for i in self.number_ids]
                if self.grouped
                else [*self.digit_ids, self.point_ids][:num_classes]
            )
            width = max(len(c) for c in classes)
            ids = torch.tensor([list(c) + [c[0]] * (width - len(c)) for c in classes])
            valid = torch.tensor([[j < len(c) for j in range(width)] for c in classes])
            self._device_cache[key] = (ids.to(device), valid.to(device))
        return self._device_cache[key]


def _check_numbers(numbers: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Multi-digit strings -> ids, checked: ASCII digits, 2..MAX_GROUP_DIGITS long, ids given."""
    out: dict[str, tuple[int, ...]] = {}
    for text, ids in sorted(numbers.items()):
        if not _NUMBER.match(text) or len(text) < 2:
            raise TokenizerError(f"number token {text!r} is not a string of 2 or more ASCII digits")
        if len(text) > MAX_GROUP_DIGITS:
            raise TokenizerError(_unbounded_message(text))
        if not ids:
            raise TokenizerError(f"number token {text!r} has no id")
        out[text] = tuple(int(i) for i in ids)
    return out


def _check_no_empty_set(numbers: Mapping[str, Sequence[int]]) -> None:
    """Every digit of every slot of every group G_k must have a token: an empty set's class
    logit would be -inf, and its p = 0 makes DIST2's KL infinite (docs/losses.md)."""
    lengths = sorted({len(s) for s in numbers})
    for k in lengths:
        for j in range(k):
            have = {s[j] for s in numbers if len(s) == k}
            if len(have) < 10:
                gap = sorted(set("0123456789") - have)[0]
                raise TokenizerError(
                    f"no {k}-digit number token has digit {gap!r} at place {j} (e.g. "
                    f"{('1' * j + gap + '0' * (k - j - 1))!r} is missing); grouped digits need "
                    "every digit in every slot of every group"
                )
        if k > 1 and k - 1 not in lengths and k - 1 > 1:
            raise TokenizerError(f"number tokens of {k} digits but none of {k - 1}")


def _unbounded_message(example: str) -> str:
    return (
        f"tokenizer merges digits into runs longer than {MAX_GROUP_DIGITS} (e.g. {example!r}, "
        f"{len(_strip_space(example))} digits: an unbounded \\d+ pattern); the numeric losses "
        f"need one token per digit or groups of 1..{MAX_GROUP_DIGITS} (\\p{{N}}{{1,3}})"
    )


def _classify_pieces(probe: list[str], pieces: list[str], usable: list[bool]) -> bool:
    """Whether digits are grouped (True) or one per token (False); refuses, in one line naming
    an example, digits merged with other characters and number pieces longer than
    MAX_GROUP_DIGITS. probe: the pieces the tokenizer made of `_PROBE_TEXT` (or all usable
    pieces when there is no encoder). A tokenizer that cuts the probe into single digits is
    single-digit, whatever unused pieces its vocabulary holds (as before grouping existed)."""
    if not any(len(_ASCII_DIGITS.findall(p)) >= 2 for p in probe):
        return False  # one token per digit: the single-digit rule, nothing more refused
    mixed = sorted(  # the most digits first: the clearest examples
        (p for p in probe if _ASCII_DIGITS.search(p) and not _NUMBER.match(_strip_space(p))),
        key=lambda p: (-len(_ASCII_DIGITS.findall(p)), p),
    )
    if mixed:
        raise TokenizerError(
            f"tokenizer merges digits with other characters (e.g. "
            f"{', '.join(repr(p) for p in mixed[:5])}); the numeric losses need number tokens "
            "of digits only"
        )
    longest = max(
        (p for p, ok in zip(pieces, usable, strict=True) if ok and _NUMBER.match(_strip_space(p))),
        key=lambda p: len(_strip_space(p)),
    )
    if len(_strip_space(longest)) > MAX_GROUP_DIGITS:
        raise TokenizerError(_unbounded_message(longest))
    return True


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
