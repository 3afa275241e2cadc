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


def grouped_number_labels(tokens: int, vocab: int, digit_share: float, gen: torch.Generator):
    """Llama-3-like: ten digit tokens and every 2- and 3-digit string a token (1110 number
    tokens at ids 100..1209, Llama-3 has them at 15..24 and spread above), numbers of 1-9
    digits written as runs of 3-digit tokens and a shorter last one (as `\\p{N}{1,3}` cuts
    them), '.' at 1210; about `digit_share` of the targets are number tokens."""
    strings = [f"{n:0{k}d}" for k in (1, 2, 3) for n in range(10**k)]
    first_id, point_id = 100, 100 + len(strings)
    ids = {s: first_id + i for i, s in enumerate(strings)}
    labels: list[int] = []
    while len(labels) < tokens:
        # numbers average 2.4 tokens: start one with probability p so that about
        # 2.4 p / (2.4 p + 1 - p) = digit_share
        if torch.rand((), generator=gen) < digit_share / (2.4 - 1.4 * digit_share):
            n = int(torch.randint(1, 10, (1,), generator=gen))
            text = "".join(str(int(d)) for d in torch.randint(10, (n,), generator=gen))
            # \p{N}{1,3} cuts from the left: 1234 -> 123, 4
            labels += [ids[text[i : i + 3]] for i in range(0, n, 3)]
            if torch.rand((), generator=gen) < 0.2:
                labels.append(point_id)
        else:
            labels.append(int(torch.randint(point_id + 1, vocab, (1,), generator=gen)))
    vocab_obj = DigitVocab(
        digit_ids=[ids[str(d)] for d in range(10)],
        point_ids=[point_id],
        vocab_size=vocab,
        numbers={s: [i] for s, i in ids.items() if len(s) > 1},
    )
    return torch.tensor(labels[:tokens]), vocab_obj
