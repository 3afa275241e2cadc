"""The fused output layer + numeric loss against megatron-core's output layer + CE.

    python bench/loss_fused.py                       # CPU, TP 2 (two processes), float32
    python bench/loss_fused.py --device cuda --dtype bf16 --tp 1 --tokens 16384 \
        --chunk 1024 --chunks 2048,4096,8192

V = 152064 (Qwen-2.5), h = 1536, 4096 tokens by default. Forward + backward of each path,
measured side by side in one run:

* megatron: its ColumnParallelLinear output layer, then `vocab_parallel_cross_entropy`;
* hook: the same output layer, then `vocab_parallel_numeric_loss` (kind=del) on the logits;
* fused: `copy_to_tensor_model_parallel_region` (the output layer's input path) into
  `vocab_parallel_fused_numeric_loss` (kind=del), the gradient formed in forward and scaled
  on the device (`promise_scaled_loss`, as the trainer runs it);
* fused-recompute: the same with `recompute=True` (logits made again in backward);
* compiled (TP 1 only, where torch.compile runs): `torch.compile` of the unfused path
  (hidden @ W^T, then F.cross_entropy).

Peak memory above the weight shard and its gradient buffer, each path in a fresh set of
processes so that allocator caches of one cannot hide another's (CPU: peak RSS via
/proc/self/clear_refs; GPU: torch.cuda.max_memory_allocated), in two settings:

* held: `.grad` exists before the step (ZeRO 1 accumulating micro-batches); the gradient
  accumulates into it;
* fresh: no `.grad` before the step (DeepSpeed ZeRO 2/3 free it after each reduction); the
  step makes it, and its size is subtracted from the peak.

Time: median of alternating repetitions (ABBA over all paths) in one set of processes.
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

PATHS = ("megatron", "hook", "fused", "fused-recompute", "compiled")


def output_layer(vocab_size: int, hidden: int, tokens: int, device, dtype):
    """megatron's ColumnParallelLinear output layer [h -> V/tp], built from the one model
    config (models/llama.model_config: megatron's CUDA RNG tracker seeded on GPU)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from del_megatron.models.architecture import LlamaArchitecture
    from del_megatron.models.llama import model_config

    arch = LlamaArchitecture(
        vocab_size=vocab_size,
        hidden_size=hidden,
        ffn_hidden_size=4 * hidden,
        num_layers=1,
        num_attention_heads=hidden // 128,
        num_query_groups=hidden // 128,
        max_position_embeddings=tokens,
        make_vocab_size_divisible_by=128,
    )
    config = model_config(arch, device, seed=0, weights_follow=False)
    return ColumnParallelLinear(
        hidden,
        arch.padded_vocab_size(parallel_state.get_tensor_model_parallel_world_size()),
        config=config,
        init_method=torch.nn.init.normal_,
        bias=False,
        gather_output=False,
        skip_bias_add=True,
    ).to(device=device, dtype=dtype)


def setup(args):
    from megatron.core import parallel_state

    from del_megatron import DigitVocab
    from del_megatron.parallel import bind_local_device
    from del_megatron.runtime import select_accelerator

    device = torch.device(args.device)
    select_accelerator(device)
    bind_local_device(device, os.environ)  # the project's one binding rule
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    layer = output_layer(args.vocab, args.hidden, args.tokens, device, dtype)
    if args.grad == "held":
        layer.weight.grad = torch.zeros_like(layer.weight)  # ZeRO 1 holds this buffer
    gen = torch.Generator().manual_seed(0)
    tokens = args.tokens
    labels = torch.randint(20, args.vocab, (1, tokens), generator=gen)
    digits = torch.rand(1, tokens, generator=gen) < 0.15
    labels = torch.where(digits, torch.randint(10, 20, (1, tokens), generator=gen), labels)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=args.vocab)
    hidden = torch.randn(tokens, 1, args.hidden, generator=gen).to(device=device, dtype=dtype)
    return device, layer, hidden, labels.to(device), vocab


def step_fn(path, layer, hidden, labels, vocab, chunk):
    """One forward + backward of `path`; with a fresh `.grad` setting, the weight's gradient
    is dropped after the step as ZeRO 2/3 do after their reduction."""
    from megatron.core import tensor_parallel

    from del_megatron import NumericLossConfig
    from del_megatron.losses import vocab_parallel_numeric_loss
    from del_megatron.losses.fused import vocab_parallel_fused_numeric_loss

    cfg = NumericLossConfig(kind="del")
    held = layer.weight.grad is not None

    def finish():
        if not held:
            layer.weight.grad = None

    def megatron():
        x = hidden.detach().requires_grad_()
        logits, _ = layer(x)  # [s, b, V/tp]
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.t())
        loss.sum().backward()
        finish()

    def hook():
        x = hidden.detach().requires_grad_()
        logits, _ = layer(x)
        out = vocab_parallel_numeric_loss(logits, labels, vocab, cfg)
        (out.loss * labels.numel()).backward()
        finish()

    def fused(recompute):
        def run():
            x = hidden.detach().requires_grad_()
            h = tensor_parallel.copy_to_tensor_model_parallel_region(x)
            # the trainer's promise: backward is the loss' own gradient, scaled (no host read)
            out = vocab_parallel_fused_numeric_loss(
                h, layer.weight, labels, vocab, cfg, chunk_tokens=chunk, recompute=recompute,
                promise_scaled_loss=True,
            )  # fmt: skip
            (out.loss * labels.numel()).backward()
            finish()

        return run

    def compiled():
        @torch.compile
        def loss_of(x, w, target):
            return torch.nn.functional.cross_entropy((x @ w.T).float(), target, reduction="sum")

        def run():
            x = hidden.detach().requires_grad_()
            loss_of(x.squeeze(1), layer.weight, labels[0]).backward()
            finish()

        return run

    return {
        "megatron": megatron,
        "hook": hook,
        "fused": fused(False),
        "fused-recompute": fused(True),
        "compiled": compiled() if dist.get_world_size() == 1 else None,
    }[path]


def worker(args) -> None:
    device, layer, hidden, labels, vocab = setup(args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    paths = args.paths.split(",")
    result = {}
    if args.mode == "time":
        fns = {p: step_fn(p, layer, hidden, labels, vocab, args.chunk) for p in paths}
        fns = {p: f for p, f in fns.items() if f is not None}
        if "compiled" in fns:
            try:
                fns["compiled"]()  # compiles; a failure leaves the path out
            except Exception as error:  # reported; the other paths go on
                print(f"compiled: left out ({type(error).__name__}: {error})"[:300], flush=True)
                del fns["compiled"]
        order = list(fns)
        times = {p: [] for p in order}
        for i in range(args.repeats + 1):  # the first round warms up
            for kind in order if i % 2 == 0 else reversed(order):  # ABBA
                sync()
                start = time.perf_counter()
                fns[kind]()
                sync()
                if i >= 1:
                    times[kind].append(time.perf_counter() - start)
        result = {p: statistics.median(v) for p, v in times.items()}
    else:
        fn = step_fn(args.mode, layer, hidden, labels, vocab, args.chunk)
        grad_bytes = layer.weight.numel() * layer.weight.element_size()
        if fn is not None and args.mode == "compiled":
            try:
                fn()  # compiling is not part of the step
            except Exception as error:  # reported; the other paths go on
                print(f"compiled: left out ({type(error).__name__}: {error})"[:300], flush=True)
                fn = None
        if fn is not None:
            peak = PeakMemory(device)
            peak.reset()
            fn()
            # fresh: the step made the gradient buffer that held counts as given
            result = {args.mode: peak.peak() - (grad_bytes if args.grad == "fresh" else 0)}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def launch(args, mode: str, grad: str = "held", **override) -> dict:
    options = {**vars(args), "grad": grad, **override}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.tp}",
        "--master_addr=127.0.0.1",
        f"--master_port={29650 + sum(map(ord, mode + grad)) % 100}",
        __file__,
        "--worker",
        "--mode",
        mode,
        *(
            f"--{k.replace('_', '-')}={v}"
            for k, v in options.items()
            if k not in ("worker", "mode", "chunks", "memory") and v is not None
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
    for line in out.stdout.splitlines():
        if line.startswith("compiled: left out"):
            print(line)
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
    p.add_argument("--chunks", default="", help="also time the fused path at these chunk sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    p.add_argument(
        "--memory", default="held,fresh", help="held, fresh or both (comma-separated), or none"
    )
    p.add_argument("--grad", default="held", choices=["held", "fresh"], help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", default="time")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    paths = [x for x in args.paths.split(",") if x != "compiled" or args.tp == 1]
    args.paths = ",".join(paths)
    shard = args.vocab // args.tp
    print(
        f"device {args.device}, {args.dtype}, TP {args.tp}, V={args.vocab} (V/tp {shard}), "
        f"h={args.hidden}, {args.tokens} tokens, chunk {args.chunk}, torch {torch.__version__}"
    )
    settings = [s for s in args.memory.split(",") if s in ("held", "fresh")]
    memory = {s: {} for s in settings}
    for setting in settings:
        for path in paths:
            memory[setting].update(launch(args, path, setting))
    times = launch(args, "time")
    mib = 2**20
    header = f"{'':16s} {'fwd+bwd s':>10s} {'time':>7s}"
    for setting in settings:
        header += f" {'MiB ' + setting:>11s} {'memory':>7s}"
    print(header)
    for path in times:
        line = f"{path:16s} {times[path]:10.2f} {times[path] / times['megatron']:6.3f}x"
        for setting in settings:
            m, base = memory[setting].get(path), memory[setting].get("megatron")
            line += f" {m / mib:11.0f} {m / base:6.3f}x" if m is not None and base else " " * 19
        print(line)
    for path in ("fused", "fused-recompute"):
        if path in times:
            # "fused / megatron: time Tx, peak memory Mx" is what bench/gpu_acceptance.py reads
            line = f"{path} / megatron: time {times[path] / times['megatron']:.3f}x"
            ratios = [
                f"{memory[s][path] / memory[s]['megatron']:.3f}x (.grad {s})"
                for s in settings
                if path in memory[s] and memory[s].get("megatron")
            ]
            if ratios:
                line += ", peak memory " + ", ".join(ratios)
            print(line)
    for chunk in filter(None, args.chunks.split(",")):
        t = launch(args, "time", chunk=int(chunk), paths="megatron,fused")
        line = f"chunk {chunk:>6s}: fused time {t['fused'] / t['megatron']:.3f}x"
        for setting in settings:
            m = launch(args, "fused", setting, chunk=int(chunk))["fused"]
            base = memory[setting].get("megatron")
            line += f", peak ({setting}) {m / mib:.0f} MiB"
            line += f" ({m / base:.3f}x)" if base else ""
        print(line)


if __name__ == "__main__":
    main()
