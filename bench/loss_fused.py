"""The fused output layer + numeric loss against megatron-core's output layer + CE.

    python bench/loss_fused.py                       # CPU, TP 2 (two processes), float32
    python bench/loss_fused.py --device cuda --dtype bf16 --tp 1 --tokens 16384

V = 152064 (Qwen-2.5), h = 1536, 4096 tokens by default. Megatron: its ColumnParallelLinear
output layer, then `vocab_parallel_cross_entropy`. Ours: the same layer's input path
(`copy_to_tensor_model_parallel_region`) into `vocab_parallel_fused_numeric_loss`
(kind=del). Forward + backward of each, measured side by side in one run:

* peak memory above the weight shard and its gradient buffer (which training holds anyway;
  both are allocated before the measurement and the gradient accumulates into its buffer),
  each in a fresh pair of processes so that allocator caches of one cannot hide the other's
  (CPU: peak RSS via /proc/self/clear_refs; GPU: torch.cuda.max_memory_allocated);
* time: median of alternating repetitions in one pair of processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from peak_memory import PeakMemory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def setup(args):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from del_megatron import DigitVocab
    from del_megatron.models.device import select_accelerator
    from del_megatron.models.llama import LlamaArchitecture, transformer_config

    device = torch.device(args.device)
    select_accelerator(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    arch = LlamaArchitecture(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        ffn_hidden_size=4 * args.hidden,
        num_layers=1,
        num_attention_heads=args.hidden // 128,
        num_query_groups=args.hidden // 128,
        max_position_embeddings=args.tokens,
        make_vocab_size_divisible_by=128,
    )
    config = transformer_config(arch, device)
    layer = ColumnParallelLinear(
        args.hidden,
        arch.padded_vocab_size(dist.get_world_size()),
        config=config,
        init_method=torch.nn.init.normal_,
        bias=False,
        gather_output=False,
        skip_bias_add=True,
    ).to(device=device, dtype=dtype)
    layer.weight.grad = torch.zeros_like(layer.weight)  # training holds this buffer anyway
    gen = torch.Generator().manual_seed(0)
    tokens = args.tokens
    labels = torch.randint(20, args.vocab, (1, tokens), generator=gen)
    digits = torch.rand(1, tokens, generator=gen) < 0.15
    labels = torch.where(digits, torch.randint(10, 20, (1, tokens), generator=gen), labels)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=args.vocab)
    hidden = torch.randn(tokens, 1, args.hidden, generator=gen).to(device=device, dtype=dtype)
    return device, layer, hidden, labels.to(device), vocab


def step_fn(kind, layer, hidden, labels, vocab, chunk):
    from megatron.core import tensor_parallel

    from del_megatron import NumericLossConfig
    from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss

    def megatron():
        x = hidden.detach().requires_grad_()
        logits, _ = layer(x)  # [s, b, V/tp]
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.t())
        loss.sum().backward()

    def fused():
        x = hidden.detach().requires_grad_()
        h = tensor_parallel.copy_to_tensor_model_parallel_region(x)
        out = vocab_parallel_fused_numeric_loss(
            h, layer.weight, labels, vocab, NumericLossConfig(kind="del"), chunk_tokens=chunk
        )
        (out.loss * labels.numel()).backward()

    return {"megatron": megatron, "fused": fused}[kind]


def worker(args) -> None:
    device, layer, hidden, labels, vocab = setup(args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {}
    if args.mode == "time":
        fns = {
            k: step_fn(k, layer, hidden, labels, vocab, args.chunk) for k in ("megatron", "fused")
        }
        times = {k: [] for k in fns}
        for i in range(2 * (args.repeats + 1)):
            kind = ("megatron", "fused")[(i + i // 2) % 2]  # ABBA
            sync()
            start = time.perf_counter()
            fns[kind]()
            sync()
            if i >= 2:
                times[kind].append(time.perf_counter() - start)
        result = {k: statistics.median(v) for k, v in times.items()}
    else:
        fn = step_fn(args.mode, layer, hidden, labels, vocab, args.chunk)
        peak = PeakMemory(device)
        peak.reset()
        fn()
        result = {args.mode: peak.peak()}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def launch(args, mode: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.tp}",
        "--master_addr=127.0.0.1",
        f"--master_port={29650 + hash(mode) % 100}",
        __file__,
        "--worker",
        "--mode",
        mode,
        *(
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k not in ("worker", "mode", "chunks") and v is not None
        ),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, os.cpu_count() // args.tp)),
        "PYTHONWARNINGS": "ignore",
    }
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-4000:])
    return json.loads(lines[-1][7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--chunks", default="", help="also time these chunk sizes (comma-separated)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", default="time")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    shard = args.vocab // args.tp
    print(
        f"device {args.device}, {args.dtype}, TP {args.tp}, V={args.vocab} (V/tp {shard}), "
        f"h={args.hidden}, {args.tokens} tokens, chunk {args.chunk}, torch {torch.__version__}"
    )
    memory = {**launch(args, "megatron"), **launch(args, "fused")}
    times = launch(args, "time")
    mib = 2**20
    print(f"{'':10s} {'fwd+bwd s':>10s} {'time':>7s} {'peak MiB':>9s} {'memory':>7s}")
    for kind in ("megatron", "fused"):
        print(
            f"{kind:10s} {times[kind]:10.2f} {times[kind] / times['megatron']:6.3f}x "
            f"{memory[kind] / mib:9.0f} {memory[kind] / memory['megatron']:6.3f}x"
        )
    print(
        f"fused / megatron: time {times['fused'] / times['megatron']:.3f}x, "
        f"peak memory {memory['fused'] / memory['megatron']:.3f}x"
    )
    for chunk in filter(None, args.chunks.split(",")):
        args.chunk = int(chunk)
        t = launch(args, "time")
        m = launch(args, "fused")["fused"]
        print(
            f"chunk {chunk:>6s}: time {t['fused'] / t['megatron']:.3f}x, "
            f"peak {m / mib:.0f} MiB ({m / memory['megatron']:.3f}x)"
        )


if __name__ == "__main__":
    main()
