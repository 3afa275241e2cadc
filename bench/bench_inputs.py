"""Inputs shared by the benchmarks (imported by the scripts beside it, never by the package)."""

from __future__ import annotations

import torch

from del_megatron import DigitVocab


def number_heavy_labels(tokens: int, vocab: int, digit_share: float, gen: torch.Generator):
    """Token ids where about `digit_share` of the targets are digits of 1-6 digit numbers."""
    digit_ids = torch.arange(100, 110)
    point_id = 110
    labels = []
    while len(labels) < tokens:
        # numbers average 3.5 digits and 0.2 points: start one with probability p so that
        # 3.5 p / (3.7 p + 1 - p) = digit_share
        if torch.rand((), generator=gen) < digit_share / (3.5 - 2.7 * digit_share):
            n = int(torch.randint(1, 7, (1,), generator=gen))
            number = digit_ids[torch.randint(10, (n,), generator=gen)].tolist()
            if n > 2 and torch.rand((), generator=gen) < 0.3:
                number.insert(n - 2, point_id)
            labels += number
        else:
            labels.append(int(torch.randint(200, vocab, (1,), generator=gen)))
    vocab_obj = DigitVocab(digit_ids=digit_ids.tolist(), point_ids=[point_id], vocab_size=vocab)
    return torch.tensor(labels[:tokens]), vocab_obj
