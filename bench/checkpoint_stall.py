"""How long a checkpoint stops training: written behind training against written while the
step waits, side by side in one run.

    python bench/checkpoint_stall.py                 # 25 M parameters, CPU, one rank

One engine and model (ZeRO 1, the layout-free state). The saves alternate between the two
ways (train.background_checkpoints true and false, ABBA order); each is taken after a step.
The stall is the time the training thread spends in the save: for a background save, the
host copy and collectives of `checkpoint/save.save` plus the `publish` that follows once the
files are written; for the other, the whole save. Prints the median stall of each and
their ratio (exit status 1 above --bound), and the median time a background save cost
training in all: its stall plus what the steps beside its writer took over a step alone
(the writer shares the CPU with them).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from math import nan
from pathlib import Path

import torch


def run_config(tokenizer: Path, output_dir: Path):
    """bench/train_step.py's CPU run with a 26.7 M-parameter model, one rank, ZeRO 1."""
    from train_step import cpu_tree  # bench/train_step.py, beside this script

    from del_megatron.config import parse_run_config

    tree = cpu_tree(tokenizer)
    tree["model"] = {
        "vocab_size": 4096,
        "hidden_size": 512,
        "ffn_hidden_size": 1408,
        "num_layers": 7,
        "num_attention_heads": 8,
        "num_query_groups": 8,
        "max_position_embeddings": 256,
        "make_vocab_size_divisible_by": 64,
    }
    tree["parallel"]["tensor_parallel"] = 1
    tree["optim"]["lr"] = 1e-4
    tree["train"].update(
        steps=1000, micro_batch_size=2, global_batch_size=2, seq_len=64, keep_checkpoints=1
    )
    tree["output_dir"] = str(output_dir)
    return parse_run_config(tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=4, help="saves of each way")
    parser.add_argument(
        "--bound", type=float, default=0.10, help="the most background / synchronous stall"
    )
    args = parser.parse_args()

    from train_step import tokenizer_path  # bench/train_step.py, beside this script

    from del_megatron.training import checkpointing
    from del_megatron.training.trainer import next_micro_batches, setup, train_step

    root = Path(tempfile.mkdtemp(prefix="del-bench-stall-"))
    cfg = run_config(tokenizer_path(root), root / "run")
    run = setup(cfg)
    gen = torch.Generator().manual_seed(0)
    b, s = cfg.train.micro_batch_size, cfg.train.seq_len

    def batch(step: int, micro: int):
        window = torch.randint(3, run.tokenizer.vocab_size, (b, s + 1), generator=gen)
        return {"tokens": window[:, :-1], "labels": window[:, 1:], "loss_mask": torch.ones(b, s)}

    step = 0

    def one_step(writing: bool = False) -> tuple[float, bool]:
        nonlocal step
        step += 1
        started = time.perf_counter()
        outcome = train_step(run, next_micro_batches(run, batch, step - 1), step, None, writing)
        return time.perf_counter() - started, outcome.writing

    quiet = [one_step()[0] for _ in range(6)]  # warm-up, then the step time without a save
    stalls: dict[bool, list[float]] = {True: [], False: []}
    beside: list[float] = []  # step times while a writer runs
    costs: list[float] = []  # a background save's stall + its steps' time over a quiet step
    for i in range(2 * args.saves):
        background = bool((i + i // 2) % 2)  # ABBA: neither way always goes first
        train = cfg.train.model_copy(update={"background_checkpoints": background})
        run.cfg = cfg.model_copy(update={"train": train})
        started = time.perf_counter()
        pending = checkpointing.save(run, step, None, keep=1)
        stall = time.perf_counter() - started
        slower = 0.0
        while True:  # the trainer's loop: publish once the step's agreement says written
            seconds, writing = one_step(not pending.writing.written())
            if writing:
                beside.append(seconds)
                slower += seconds - statistics.median(quiet)
                continue
            started = time.perf_counter()
            checkpointing.publish(run, pending)
            stall += time.perf_counter() - started
            break
        stalls[background].append(stall)
        if background:
            costs.append(stall + slower)
        quiet.append(one_step()[0])
    shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in run.engine.module.parameters())
    sync, behind = statistics.median(stalls[False]), statistics.median(stalls[True])
    step_s = statistics.median(quiet)
    print(f"{params / 1e6:.1f} M parameters, CPU, one rank, {args.saves} saves of each way")
    print(f"{'save':12s} {'stall ms':>9s} {'ratio':>7s}")
    print(f"{'synchronous':12s} {sync * 1e3:9.1f} {1.0:6.3f}x")
    print(f"{'background':12s} {behind * 1e3:9.1f} {behind / sync:6.3f}x")
    print(
        f"step {step_s * 1e3:.1f} ms alone, {statistics.median(beside or [nan]) * 1e3:.1f} ms "
        f"beside the writer ({len(beside)} steps); a background save cost training "
        f"{statistics.median(costs) * 1e3:.1f} ms in all, {statistics.median(costs) / sync:.3f}x "
        "the synchronous stall"
    )
    verdict = "pass" if behind <= args.bound * sync else "FAIL"
    print(f"{verdict}: background stall {behind / sync:.3f}x <= {args.bound}x the synchronous")
    if verdict == "FAIL":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
