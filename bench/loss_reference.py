"""Forward+backward time of numeric_loss(kind="del") over F.cross_entropy, side by side.

    python bench/loss_reference.py [--tokens 3000] [--vocab 32000] [--repeats 15]

Logits [tokens, vocab] float32 with ~15% digit targets in numbers of 1-6 digits (some
decimals). The two are timed alternately in one process; the ratio of medians is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss


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


def time_fwd_bwd(fn, logits) -> float:
    x = logits.detach().requires_grad_()
    start = time.perf_counter()
    fn(x).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    labels, vocab = number_heavy_labels(args.tokens, args.vocab, 0.15, gen)
    logits = torch.randn(args.tokens, args.vocab, generator=gen)
    cfg = NumericLossConfig(kind="del")
    digit_share = numeric_loss(logits, labels, vocab, cfg).stats["digits"].item() / args.tokens

    candidates = {
        "F.cross_entropy": lambda x: F.cross_entropy(x, labels),
        "numeric_loss(del)": lambda x: numeric_loss(x, labels, vocab, cfg).loss,
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(3):  # warm-up
        for fn in candidates.values():
            time_fwd_bwd(fn, logits)
    for _ in range(args.repeats):
        for name, fn in candidates.items():
            times[name].append(time_fwd_bwd(fn, logits))

    base = statistics.median(times["F.cross_entropy"])
    print(
        f"logits [{args.tokens}, {args.vocab}] float32, digit targets {digit_share:.1%}, "
        f"threads {torch.get_num_threads()}, torch {torch.__version__}"
    )
    print(f"{'':20s} {'median ms':>10s} {'ratio':>7s}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:20s} {median * 1e3:10.1f} {median / base:7.3f}x")


if __name__ == "__main__":
    main()
