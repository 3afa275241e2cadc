"""Random batches of token ids full of numbers, for the loss tests and the benchmark shapes."""

from __future__ import annotations

import torch

from del_megatron import DigitVocab

VOCAB_SIZE = 40
DIGIT_IDS = [5, 9, 13, 14, [20, 39], 22, 27, 30, 33, 36]  # '4' has two tokens
POINT_IDS = [17, 38]
OTHER_IDS = [
    i for i in range(VOCAB_SIZE) if i not in {5, 9, 13, 14, 20, 39, 22, 27, 30, 33, 36, 17, 38}
]


def make_vocab(vocab_size: int | None = VOCAB_SIZE) -> DigitVocab:
    return DigitVocab(digit_ids=DIGIT_IDS, point_ids=POINT_IDS, vocab_size=vocab_size)


def _digit(gen: torch.Generator, value: int) -> int:
    ids = DIGIT_IDS[value]
    if isinstance(ids, list):
        return ids[int(torch.randint(len(ids), (1,), generator=gen))]
    return ids


def number_sequence(gen: torch.Generator, length: int) -> list[int]:
    """Words, integers, decimals, '.5', '3.14.15' and separators, cut to `length`."""
    out: list[int] = []
    while len(out) < length:
        r = float(torch.rand((), generator=gen))
        if r < 0.35:
            out.append(OTHER_IDS[int(torch.randint(len(OTHER_IDS), (1,), generator=gen))])
            continue

        def digits(n):
            return [_digit(gen, int(torch.randint(10, (1,), generator=gen))) for _ in range(n)]

        n_int = int(torch.randint(0, 7, (1,), generator=gen))
        part = digits(n_int)
        if r < 0.7 or n_int == 0:
            part += [POINT_IDS[int(r * 100) % 2]] + digits(
                int(torch.randint(1, 4, (1,), generator=gen))
            )
            if r < 0.45:
                part += [POINT_IDS[0]] + digits(2)  # a second '.'
        out += part
    return out[:length]


def make_batch(
    batch: int,
    seq: int,
    *,
    seed: int = 0,
    mask_share: float = 0.1,
    ignore_share: float = 0.05,
    vocab_size: int = VOCAB_SIZE,
):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.tensor([number_sequence(gen, seq) for _ in range(batch)])
    labels[torch.rand(labels.shape, generator=gen) < ignore_share] = -100
    loss_mask = (torch.rand(labels.shape, generator=gen) >= mask_share).float()
    return labels, loss_mask
