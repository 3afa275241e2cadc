"""The numeric-loss hook on vocabulary shards against megatron-core's cross entropy.

    torchrun --nproc_per_node=2 bench/loss_tp.py                       # CPU, float32, TP 2
    torchrun --nproc_per_node=2 bench/loss_tp.py --grouped --vocab 128256 --tokens 1024
    python bench/loss_tp.py --device cuda --dtype bf16 --vocab 152064 --tokens 16384  # GPU, TP 1

Forward+backward time (median of alternating repetitions, one run) and peak memory of
`vocab_parallel_numeric_loss(kind="del")` over megatron's CE on the same shards: the unfused
`vocab_parallel_cross_entropy` on CPU, the fused one on GPU. Megatron's CE overwrites float32
input logits; the hook never does. So for float32 two cases are measured: the caller keeps
its logits (megatron gets a copy, counted in its peak) and the caller hands them over
(megatron may overwrite them). Peak memory is that of logits made by a stand-in output layer
plus what the loss allocates, forward and backward (CPU: from the process's peak RSS; GPU:
torch.cuda.max_memory_allocated); time is the loss alone on a leaf copy of the shard.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from bench_inputs import grouped_number_labels, number_heavy_labels
from peak_memory import PeakMemory

from del_megatron import NumericLossConfig, vocab_parallel_numeric_loss


class _Producer(torch.autograd.Function):
    """Stands for the output layer: hands out fresh logits, takes their gradient, keeps none."""

    @staticmethod
    def forward(ctx, base):
        return base.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def time_once(fn: Callable, shard: torch.Tensor, sync) -> float:
    """Seconds of fn's forward + backward on a fresh leaf copy of the shard."""
    x = shard.detach().clone().requires_grad_()  # megatron's CE overwrites float32 input
    sync()
    start = time.perf_counter()
    fn(x).backward()
    sync()
    return time.perf_counter() - start


def peak_once(fn: Callable, shard: torch.Tensor, memory: PeakMemory, keep: bool) -> int:
    """Peak bytes above the caller's state, the produced logits included, while fn's loss runs
    on logits made as by an output layer; keep: the caller holds its logits until after
    backward (so a loss that overwrites them gets a copy)."""
    base = shard.detach().requires_grad_()
    memory.reset()
    logits = _Producer.apply(base)
    loss = fn(logits.clone() if keep and fn.overwrites else logits)
    if not keep:
        del logits
    loss.backward()
    peak = memory.peak()
    del loss
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--grouped",
        action="store_true",
        help="a Llama-3-like tokenizer: number tokens of 1..3 digits (use --vocab 128256)",
    )
    args = parser.parse_args()

    from del_megatron.parallel import bind_local_device

    device = torch.device(args.device)
    bind_local_device(device, os.environ)  # the project's one binding rule, before NCCL's
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method="tcp://127.0.0.1:29512",
            rank=0,
            world_size=1,
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    gen = torch.Generator().manual_seed(0)
    seq, batch = args.tokens // 2, 2
    make_labels = grouped_number_labels if args.grouped else number_heavy_labels
    labels, vocab = make_labels(args.tokens, args.vocab, 0.15, gen)
    labels = labels.view(batch, seq).to(device)  # [b, s]
    target_sb = labels.t().contiguous()
    local = args.vocab // world
    shard = (torch.randn(seq, batch, local, generator=gen) * 2).to(device, dtype)
    shard.requires_grad_()
    cfg = NumericLossConfig(kind="del")

    if device.type == "cuda":
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        def megatron_ce(x):
            return fused_vocab_parallel_cross_entropy(
                x, target_sb, parallel_state.get_tensor_model_parallel_group()
            )
    else:
        megatron_ce = tensor_parallel.vocab_parallel_cross_entropy

    def hook(x):
        return vocab_parallel_numeric_loss(x, labels, vocab, cfg).loss

    def megatron_loss(x):
        if device.type == "cuda":
            return megatron_ce(x).mean()
        return megatron_ce(x, target_sb).mean()

    megatron_loss.overwrites = dtype == torch.float32  # its in-place trick needs a float32 input
    hook.overwrites = False
    candidates = {
        "megatron fused CE" if device.type == "cuda" else "megatron CE": megatron_loss,
        "hook (kind=del)": hook,
    }

    memory = PeakMemory(device)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for repeat in range(args.repeats + 2):
        for name, fn in candidates.items():
            elapsed = time_once(fn, shard, sync)
            if repeat >= 2:  # warm-up
                times[name].append(elapsed)
    peaks = {  # the produced logits + what the loss allocates, MiB
        (name, keep): max(peak_once(fn, shard, memory, keep) for _ in range(2)) / 2**20
        for name, fn in candidates.items()
        for keep in (False, True)
    }

    share = vocab_parallel_numeric_loss(shard, labels, vocab, cfg).stats["digits"].item()
    if rank == 0:
        print(
            f"device {device.type}, {args.dtype}, TP {world}, logits [{seq}, {batch}, "
            f"{local}] per rank, V={args.vocab}, digits per token {share / args.tokens:.1%}, "
            f"{vocab.describe()}, "
            f"torch {torch.__version__}"
        )
        base, ours = candidates
        base_time = statistics.median(times[base])
        print(
            f"{'':20s} {'fwd+bwd ms':>10s} {'time':>7s}  {'peak MiB, logits':>16s} "
            f"{'peak MiB, logits':>16s}"
        )
        print(f"{'':20s} {'':>10s} {'':>7s}  {'handed over':>16s} {'kept by caller':>16s}")
        for name in candidates:
            median = statistics.median(times[name])
            print(
                f"{name:20s} {median * 1e3:10.1f} {median / base_time:6.3f}x  "
                f"{peaks[name, False]:16.0f} {peaks[name, True]:16.0f}"
            )
        print(
            f"hook / {base}: time {statistics.median(times[ours]) / base_time:.3f}x, "
            f"peak {peaks[ours, False] / peaks[base, False]:.3f}x (logits handed over), "
            f"{peaks[ours, True] / peaks[base, True]:.3f}x (logits kept by the caller)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
