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


# ---- a grouped tokenizer (number tokens of 1..3 digits), in ids -------------------------


def _grouped_layout() -> tuple[dict[int, str], list[int], int]:
    """id -> digit string of every number token ('7' twice, as '7' and '▁7'; three 2-digit
    strings missing; 3-digit strings partly present), two '.' ids and twenty others, all at
    shuffled ids so groups spread over vocabulary shards. Returns (strings, points, size)."""
    gen = torch.Generator().manual_seed(29)
    texts = [str(d) for d in range(10)] + ["7"]
    texts += [f"{n:02d}" for n in range(100) if f"{n:02d}" not in ("05", "50", "99")]
    three = {str(d) * 3 for d in range(10)}
    three |= {f"{int(n):03d}" for n in torch.randint(1000, (15,), generator=gen)}
    texts += sorted(three)
    size = len(texts) + 2 + 20
    order = torch.randperm(size, generator=gen).tolist()
    strings = {order[i]: text for i, text in enumerate(texts)}
    points = order[len(texts) : len(texts) + 2]
    return strings, points, size


GROUPED_STRINGS, GROUPED_POINT_IDS, GROUPED_VOCAB_SIZE = _grouped_layout()
GROUPED_OTHER_IDS = [
    i for i in range(GROUPED_VOCAB_SIZE) if i not in GROUPED_STRINGS and i not in GROUPED_POINT_IDS
]


def make_grouped_vocab() -> DigitVocab:
    singles: list[list[int]] = [[] for _ in range(10)]
    numbers: dict[str, list[int]] = {}
    for i, text in sorted(GROUPED_STRINGS.items()):
        if len(text) == 1:
            singles[int(text)].append(i)
        else:
            numbers.setdefault(text, []).append(i)
    return DigitVocab(singles, GROUPED_POINT_IDS, vocab_size=GROUPED_VOCAB_SIZE, numbers=numbers)


def grouped_sequence(gen: torch.Generator, length: int) -> list[int]:
    """Words and numbers written as runs of 1..3-digit tokens, decimals, '.5', second '.'."""
    by_length: dict[int, list[int]] = {}
    for i, text in GROUPED_STRINGS.items():
        by_length.setdefault(len(text), []).append(i)

    def pick(ids: list[int]) -> int:
        return ids[int(torch.randint(len(ids), (1,), generator=gen))]

    def run() -> list[int]:
        n = int(torch.randint(1, 4, (1,), generator=gen))
        return [pick(by_length[int(torch.randint(1, 4, (1,), generator=gen))]) for _ in range(n)]

    out: list[int] = []
    while len(out) < length:
        r = float(torch.rand((), generator=gen))
        if r < 0.3:
            out.append(pick(GROUPED_OTHER_IDS))
        elif r < 0.6:
            out += run()
        elif r < 0.8:
            out += run() + [GROUPED_POINT_IDS[0]] + run()
        elif r < 0.9:
            out += [GROUPED_POINT_IDS[1]] + run()
        else:
            out += run() + [GROUPED_POINT_IDS[0]] + run() + [GROUPED_POINT_IDS[1]] + run()
    return out[:length]


def make_grouped_batch(batch: int, seq: int, *, seed: int = 0, mask_share: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.tensor([grouped_sequence(gen, seq) for _ in range(batch)])
    labels[torch.rand(labels.shape, generator=gen) < 0.05] = -100
    loss_mask = (torch.rand(labels.shape, generator=gen) >= mask_share).float()
    return labels, loss_mask
