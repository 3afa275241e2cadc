"""Forward+backward time of numeric_loss(kind="del") over F.cross_entropy, side by side.

    python bench/loss_reference.py [--tokens 3000] [--vocab 32000] [--repeats 15] [--grouped]

Logits [tokens, vocab] float32 with ~15% digit targets in numbers of 1-6 digits (some
decimals). The two are timed alternately in one process; the ratio of medians is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from bench_inputs import grouped_number_labels, number_heavy_labels

from del_megatron import NumericLossConfig, numeric_loss


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
    parser.add_argument(
        "--grouped",
        action="store_true",
        help="a Llama-3-like tokenizer: number tokens of 1..3 digits (use --vocab 128256)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    make_labels = grouped_number_labels if args.grouped else number_heavy_labels
    labels, vocab = make_labels(args.tokens, args.vocab, 0.15, gen)
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
        f"logits [{args.tokens}, {args.vocab}] float32, {vocab.describe()}, "
        f"digits per token {digit_share:.1%}, "
        f"threads {torch.get_num_threads()}, torch {torch.__version__}"
    )
    print(f"{'':20s} {'median ms':>10s} {'ratio':>7s}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:20s} {median * 1e3:10.1f} {median / base:7.3f}x")


if __name__ == "__main__":
    main()
