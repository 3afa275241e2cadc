"""Training step time with kind="del" over kind="mle", side by side in one run; with
--engines, train.engine=megatron over the deepspeed engine instead.

    torchrun --nproc_per_node=2 bench/train_step.py              # tiny CPU model, TP 2
    python bench/train_step.py --gpu-7b                          # 4-layer Llama-2-7B widths, GPU
    torchrun --nproc_per_node=2 bench/train_step.py --engines    # both engines, kind del
    python bench/train_step.py --gpu-7b --engines                # both, with TFLOP/s and MFU

--engines: two runs in one process, one per engine, at the same layout, from the same seed
(the same initial weights), stepped in ABBA order on the same batches; each engine's step
time and tokens/s (synchronised timer) beside the trainer's tokens/s, TFLOP/s per GPU and MFU
(the trainer's count, as below; nan on CPU), and the loss each reported (the check that both
ran the same step); then megatron's figures over deepspeed's, side by side.

One engine, one model; the loss kind is switched between alternating steps by handing the
model the loss head of that kind (`NumericLossGPTModel.head`, which its forward calls; the
MLE and DEL heads hold no parameters or buffers, so the engine sees the same model), so
everything else is identical. Prints the median step time of each and the ratio, tokens/s
from that time (synchronised around each step) beside the trainer's own (from its step time,
which ends at the step's agreement), on GPU TFLOP/s per GPU and MFU as the trainer reports
them, and the numeric term each kind's steps reported (nan for MLE, which has none: the
check that the variants really differ).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def tokenizer_path(root: Path) -> Path:
    from data_tools.synth import write_corpus
    from data_tools.tokenizer_train import train_tokenizer

    train, _ = write_corpus(root / "corpus", documents=1500, heldout=1, seed=0)
    return train_tokenizer([train], root / "tokenizer.model", vocab_size=1000)


def cpu_tree(tokenizer: Path) -> dict:
    """The run config of the tiny CPU model (TP 2), as a tree other benches start from."""
    return {
        "model": {
            "vocab_size": 1024,
            "hidden_size": 128,
            "ffn_hidden_size": 352,
            "num_layers": 4,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "max_position_embeddings": 256,
            "make_vocab_size_divisible_by": 64,
        },
        "parallel": {"tensor_parallel": 2, "zero_stage": 1},
        "optim": {"lr": 1e-3},
        "train": {
            "steps": 1,
            "micro_batch_size": 8,
            "global_batch_size": 16,
            "seq_len": 128,
            "device": "cpu",
        },
        "data": {"tokenizer": str(tokenizer), "sources": [{"manifest": "unused.json"}]},
        "logging": {"wandb": "disabled", "progress_bar": False},
        "output_dir": "/tmp/del-bench-train-step",
    }


def run_config(tokenizer: Path, gpu_7b: bool):
    from del_megatron.config import parse_run_config

    tree = cpu_tree(tokenizer)
    if gpu_7b:  # Llama-2-7B widths, 4 layers, 32000 tokens, sequence 4096, bf16, TP 1
        tree["model"] = {
            "vocab_size": 32000,
            "hidden_size": 4096,
            "ffn_hidden_size": 11008,
            "num_layers": 4,
            "num_attention_heads": 32,
            "num_query_groups": 32,
            "max_position_embeddings": 4096,
        }
        tree["parallel"] = {"tensor_parallel": 1, "zero_stage": 1}
        tree["train"] = {
            "steps": 1,
            "micro_batch_size": 1,
            "global_batch_size": 4,
            "seq_len": 4096,
            "device": "cuda",
            "activation_checkpointing": False,
        }
    return parse_run_config(tree)


def engine_config(cfg, engine: str):
    """`cfg` on `engine` (no checkpoints: a benchmark)."""
    train = {**cfg.train.model_dump(), "engine": engine, "checkpoints": False}
    return cfg.model_validate({**cfg.model_dump(), "train": train})


def compare_engines(cfg, args, batch_of) -> None:
    """The deepspeed and the megatron engine, one run each in this process, ABBA."""
    from del_megatron.runtime import synchronize
    from del_megatron.training.trainer import next_micro_batches, setup, train_step

    engines = ("deepspeed", "megatron")
    runs = {}
    for engine in engines:  # the second setup re-makes megatron's groups: the same ranks
        runs[engine] = setup(engine_config(cfg, engine))
    times: dict[str, list[float]] = {e: [] for e in engines}
    reported: dict[str, list[float]] = {e: [] for e in engines}  # the trainer's tokens/s
    tflops: dict[str, list[float]] = {e: [] for e in engines}  # per GPU, the trainer's
    rates: dict[str, list[float]] = {e: [] for e in engines}  # MFU, the trainer's
    losses: dict[str, list[float]] = {e: [] for e in engines}
    steps = {e: 0 for e in engines}
    for i in range(args.warmup + 2 * args.steps):
        engine = engines[(i + i // 2) % 2]  # ABBA order: no engine always goes first
        run = runs[engine]
        batch = batch_of(run)
        synchronize(run.device)
        start = time.perf_counter()
        outcome = train_step(run, next_micro_batches(run, batch, steps[engine]), steps[engine] + 1)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times[engine].append(elapsed)
            reported[engine].append(outcome.metrics.host["tokens_per_s"])
            tflops[engine].append(outcome.metrics.host.get("tflops", float("nan")))
            rates[engine].append(outcome.metrics.host.get("mfu", float("nan")))
        losses[engine].append(outcome.metrics.values()["loss"])  # after the timing
        steps[engine] += 1
    run = runs["deepspeed"]
    if run.is_main:
        base = statistics.median(times["deepspeed"])
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        print(
            f"{'GPU 4-layer Llama-2-7B widths' if args.gpu_7b else 'tiny CPU model'}, "
            f"TP {cfg.parallel.tensor_parallel}, DP {run.dp_size}, {tokens} tokens a step, "
            f"kind {cfg.loss.kind}"
        )
        print(
            f"{'engine':10s} {'step ms':>9s} {'ratio':>7s} {'tokens/s':>10s} "
            f"{'trainer':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'loss':>9s}"
        )
        figures = {}  # engine -> tokens/s (timed), tokens/s (trainer), TFLOP/s, MFU
        for engine in engines:
            median = statistics.median(times[engine])
            timed, trainer, flops, mfu = figures[engine] = (
                tokens / median,
                *(statistics.median(values[engine]) for values in (reported, tflops, rates)),
            )
            print(
                f"{engine:10s} {median * 1e3:9.1f} {median / base:6.3f}x {timed:10.0f} "
                f"{trainer:10.0f} {flops:8.1f} {mfu:6.3f} {losses[engine][-1]:9.5f}"
            )
        # the trainer's TFLOP/s and MFU are its tokens/s times one count (and over one peak):
        # their ratios are its tokens/s ratio; the timed one comes from the bench's own timer
        ratio = [m / d for m, d in zip(figures["megatron"], figures["deepspeed"], strict=True)]
        print(
            "megatron / deepspeed: tokens/s {:.3f}x (timed), {:.3f}x (trainer), "
            "TFLOP/s {:.3f}x, MFU {:.3f}x".format(*ratio)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-7b", action="store_true")
    parser.add_argument("--engines", action="store_true", help="megatron's engine over deepspeed's")
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a digit-splitting tokenizer to use (default: one trained here on a synthetic corpus)",
    )
    args = parser.parse_args()

    from del_megatron.losses import NumericLossConfig, NumericLossHead
    from del_megatron.runtime import synchronize
    from del_megatron.training.trainer import next_micro_batches, setup, train_step

    root = Path(tempfile.mkdtemp(prefix="del-bench-step-"))
    cfg = run_config(args.tokenizer or tokenizer_path(root), args.gpu_7b)
    b, s = cfg.train.micro_batch_size, cfg.train.seq_len

    def batch_of(run):
        """(step, micro) -> a micro-batch, the same for every run: seeded by both."""
        digits = torch.tensor([ids[0] for ids in run.tokenizer.digit_vocab.digit_ids])

        def batch(step: int, micro: int):
            gen = torch.Generator().manual_seed(1000 * step + micro)
            window = torch.randint(3, run.tokenizer.vocab_size, (b, s + 1), generator=gen)
            is_digit = torch.rand(window.shape, generator=gen) < 0.15
            window = torch.where(
                is_digit, digits[torch.randint(10, window.shape, generator=gen)], window
            )
            return {
                "tokens": window[:, :-1],
                "labels": window[:, 1:],
                "loss_mask": torch.ones(b, s),
            }

        return batch

    if args.engines:
        compare_engines(cfg, args, batch_of)
        return
    run = setup(cfg)
    batch = batch_of(run)

    model = run.engine.module
    heads = {
        kind: NumericLossHead(run.tokenizer.digit_vocab, NumericLossConfig(kind=kind))
        for kind in ("mle", "del")
    }
    times: dict[str, list[float]] = {k: [] for k in heads}
    rates: dict[str, list[float]] = {k: [] for k in heads}
    tflops: dict[str, list[float]] = {k: [] for k in heads}
    reported: dict[str, list[float]] = {k: [] for k in heads}  # the trainer's tokens/s
    numeric: dict[str, list[float]] = {k: [] for k in heads}
    for i in range(args.warmup + 2 * args.steps):
        kind = ("del", "mle")[(i + i // 2) % 2]  # ABBA order: no kind always goes first
        model.head = heads[kind]
        synchronize(run.device)
        start = time.perf_counter()
        # the step ends with the ranks' agreement, a host synchronisation: its time is the
        # device's; MFU from that time as the trainer reports it
        outcome = train_step(run, next_micro_batches(run, batch, i), i + 1)
        if i >= args.warmup:
            times[kind].append(time.perf_counter() - start)
            rates[kind].append(outcome.metrics.host.get("mfu", float("nan")))
            tflops[kind].append(outcome.metrics.host.get("tflops", float("nan")))
            reported[kind].append(outcome.metrics.host["tokens_per_s"])
            numeric[kind].append(outcome.metrics.values()["numeric"])  # after the timing
    if run.is_main:
        base = statistics.median(times["mle"])
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        print(
            f"{'GPU 4-layer Llama-2-7B widths' if args.gpu_7b else 'tiny CPU model'}, "
            f"TP {cfg.parallel.tensor_parallel}, DP {run.dp_size}, {tokens} tokens a step"
        )
        print(
            f"{'kind':6s} {'step ms':>9s} {'ratio':>7s} {'tokens/s':>10s} {'trainer':>10s} "
            f"{'TFLOP/s':>8s} {'MFU':>6s} {'numeric':>8s}"
        )
        for kind in ("mle", "del"):
            median = statistics.median(times[kind])
            mfu = statistics.median(rates[kind])
            flops = statistics.median(tflops[kind])  # per GPU, as the trainer counts them
            print(
                f"{kind:6s} {median * 1e3:9.1f} {median / base:6.3f}x {tokens / median:10.0f} "
                f"{statistics.median(reported[kind]):10.0f} {flops:8.1f} {mfu:6.3f} "
                f"{statistics.fmean(numeric[kind]):8.4f}"
            )


if __name__ == "__main__":
    from del_megatron.parallel import end_distributed

    try:
        main()
    finally:
        # a gloo group alive as the interpreter ends can abort the process (docs/log.md,
        # 2026-12-05): the warm test launcher found this benchmark leaving its groups
        end_distributed()
