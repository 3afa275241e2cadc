"""Helpers: turn loader batches back into token streams."""

from __future__ import annotations

import numpy as np


def windows(batch) -> tuple[np.ndarray, np.ndarray]:
    """[b, s+1] tokens and the target mask aligned to them (position 0 has none)."""
    full = np.concatenate([batch["tokens"][:, :1].numpy(), batch["labels"].numpy()], axis=1)
    mask = np.concatenate([np.ones((full.shape[0], 1)), batch["loss_mask"].numpy()], axis=1)
    return full, mask


def stream_of(batches) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive windows overlap by one token: the stream they were cut from."""
    tokens, masks = [], []
    for batch in batches:
        full, mask = windows(batch)
        for w, m in zip(full, mask, strict=True):
            if tokens:
                w, m = w[1:], m[1:]
            tokens.append(w)
            masks.append(m)
    if not tokens:
        return np.zeros(0, np.int64), np.zeros(0)
    return np.concatenate(tokens), np.concatenate(masks)


def documents_of(tokens: np.ndarray, mask: np.ndarray, eos: int) -> list[tuple[int, ...]]:
    """Split a stream at trained EOS tokens (padding EOS carry mask 0)."""
    docs, start = [], 0
    for i in np.flatnonzero((tokens == eos) & (mask > 0)):
        docs.append(tuple(tokens[start:i].tolist()))
        start = i + 1
    return docs
