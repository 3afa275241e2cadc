"""Statistics of a shard directory: documents, tokens, digit-token share, number lengths, and
the first documents decoded, their prompt (loss mask 0) apart from what is trained on."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from del_megatron.data.format import DataError, read_manifest, read_shard, resolve
from del_megatron.tokenizer import Tokenizer


def _manifest_of(path: Path) -> Path:
    """The manifest, also when given the shard directory that `build` printed."""
    return path / "manifest.json" if path.is_dir() else path


def _tokenizer_beside(manifest_path: Path, name: str, fingerprint: str) -> Path | None:
    """The manifest names its tokenizer's file (no directory): the file of that name in the
    shard directory or up to three above it (runs/tiny/shards/train -> runs/tiny), if it is
    the very tokenizer (same fingerprint)."""
    for directory in list(manifest_path.resolve().parents)[:4]:
        candidate = directory / name
        if candidate.is_file():
            try:
                if Tokenizer(candidate).fingerprint == fingerprint:
                    return candidate
            except Exception:
                continue
    return None


def inspect_shards(
    manifest_path: Path, tokenizer_path: Path | None = None, samples: int = 1
) -> dict:
    """Counts from the shards themselves (every shard read and checked), and the first
    `samples` documents decoded when the tokenizer is known (given, or found by name beside
    the shards)."""
    manifest_path = _manifest_of(manifest_path)
    manifest = read_manifest(str(manifest_path))
    digit_table = tokenizer = None
    if tokenizer_path is None:
        info = manifest.tokenizer
        tokenizer_path = _tokenizer_beside(manifest_path, info.source, info.fingerprint)
    if tokenizer_path is not None:
        tokenizer = Tokenizer(tokenizer_path)
        if tokenizer.fingerprint != manifest.tokenizer.fingerprint:
            raise DataError(f"{tokenizer_path} is not the tokenizer these shards were built with")
        digit_table = np.zeros(max(tokenizer.vocab_size, manifest.tokenizer.vocab_size), bool)
        digit_vocab = tokenizer.digit_vocab
        # number tokens: single digits, and the 2..m-digit ones of a grouped tokenizer
        for ids in (*digit_vocab.digit_ids, *digit_vocab.numbers.values()):
            digit_table[list(ids)] = True
    documents = tokens = digits = masked = 0
    lengths: Counter[int] = Counter()
    shown: list[dict] = []
    for entry in manifest.shards:
        for doc in read_shard(resolve(str(manifest_path), entry.name), entry, allow_pipe=False):
            if tokenizer is not None and len(shown) < samples:
                shown.append(_decoded(tokenizer, doc.tokens, doc.mask))
            documents += 1
            tokens += len(doc.tokens)
            masked += 0 if doc.mask is None else int((doc.mask == 0).sum())
            if digit_table is not None and len(doc.tokens):
                is_digit = digit_table[doc.tokens]
                digits += int(is_digit.sum())
                # run lengths of consecutive digit tokens
                edges = np.diff(np.concatenate([[0], is_digit.astype(np.int8), [0]]))
                starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
                lengths.update((ends - starts).tolist())
    stats = {
        "shards": len(manifest.shards),
        "documents": documents,
        "tokens": tokens,
        "prompt_tokens": masked,
        "tokenizer": manifest.tokenizer.fingerprint,
        "inputs": [  # what came from where (version 1 manifests: names only)
            entry if isinstance(entry, str) else entry.model_dump(mode="json")
            for entry in manifest.inputs
        ],
    }
    if digit_table is not None:
        stats["tokenizer_file"] = str(tokenizer_path)
        stats["digit_tokens"] = digits
        stats["digit_share"] = digits / tokens if tokens else 0.0
        stats["number_length_histogram"] = dict(sorted(lengths.items()))
        stats["samples"] = shown
    else:
        stats["digit_tokens"] = (
            f"give --tokenizer: the manifest names {manifest.tokenizer.source}, not found "
            "beside the shards"
        )
    return stats


def _decoded(tokenizer: Tokenizer, ids: np.ndarray, mask: np.ndarray | None) -> dict:
    """One document as text: the prompt (loss mask 0, not trained on) and the trained part.
    Instruction data is stored as the prompt's tokens then the response's, each encoded on
    its own, with nothing added between them."""
    ids = ids.tolist()
    if mask is None:
        return {"trained": tokenizer.decode(ids)}
    prompt = [t for t, m in zip(ids, mask.tolist(), strict=True) if m == 0]
    trained = [t for t, m in zip(ids, mask.tolist(), strict=True) if m != 0]
    return {
        "prompt (not trained on)": tokenizer.decode(prompt),
        "trained": tokenizer.decode(trained),
    }
