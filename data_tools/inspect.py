"""Statistics of a shard directory: documents, tokens, digit-token share, number lengths."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from del_megatron.data.format import DataError, read_manifest, read_shard, resolve
from del_megatron.tokenizer import Tokenizer


def inspect_shards(manifest_path: Path, tokenizer_path: Path | None = None) -> dict:
    """Counts from the shards themselves (every shard read and checked)."""
    manifest = read_manifest(str(manifest_path))
    digit_table = None
    if tokenizer_path is not None:
        tokenizer = Tokenizer(tokenizer_path)
        if tokenizer.fingerprint != manifest.tokenizer.fingerprint:
            raise DataError(f"{tokenizer_path} is not the tokenizer these shards were built with")
        digit_table = np.zeros(max(tokenizer.vocab_size, manifest.tokenizer.vocab_size), bool)
        for ids in tokenizer.digit_vocab.digit_ids:
            digit_table[list(ids)] = True
    documents = tokens = digits = masked = 0
    lengths: Counter[int] = Counter()
    for entry in manifest.shards:
        for doc in read_shard(resolve(str(manifest_path), entry.name), entry, allow_pipe=False):
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
        stats["digit_tokens"] = digits
        stats["digit_share"] = digits / tokens if tokens else 0.0
        stats["number_length_histogram"] = dict(sorted(lengths.items()))
    return stats
