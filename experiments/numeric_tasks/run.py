"""The numeric-task protocol (launch/experiments/numeric_tasks.sh): every loss kind x every
seed trained on the same task suite with the same model and schedule, each run's
checkpoints at fixed steps evaluated per task (`del_megatron.evaluation.task_suite`), then
the report with each kind's difference to MLE paired by seed (`report`).

    python -m experiments.numeric_tasks.run [--ci] [--root DIR] [--out DIR]
        [--jobs N] [--kinds K ...] [--seeds S ...] [--steps N] [--eval-every N]
    python -m experiments.numeric_tasks.run evaluate-run RUN_DIR --suite DIR
        --greedy-limit N   (one run's checkpoints; what the protocol starts per run)

Resumable: a run is done when its metrics.json exists (written atomically after its last
checkpoint is evaluated) and is never trained again; a run without it was cut short and
starts again from nothing. Runs of another protocol in the same root are refused, not
mixed. One progress line per finished run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from del_megatron.errors import UserError
from del_megatron.outputs import write_text_atomic

from .. import REPOSITORY

ALL_KINDS = ("mle", "del", "ntl_was", "ntl_mse", "dist2", "mixce", "emo", "del_distance")
# The model and schedule, found from this checkout whatever the working directory; named
# relative to it, as protocol.json records it.
CONFIG = "configs/numeric_tasks_cpu.yaml"


@dataclass(frozen=True)
class Protocol:
    kinds: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int
    eval_every: int  # the learning curves' steps: every this many, and the last
    documents: int  # training documents of the task suite
    heldout: int  # held-out problems a task
    greedy_limit: int  # greedy answers a task at each evaluated step
    data_seed: int = 0
    config: str = CONFIG

    def fingerprint(self) -> dict:
        """What makes two runs of one kind and seed the same run (kinds and seeds aside)."""
        same = asdict(self)
        del same["kinds"], same["seeds"]
        return same


# Chosen by the pilot (docs/log.md, 2026-12-01); about 2 hours on 2 idle cores.
FULL = Protocol(
    kinds=ALL_KINDS,
    seeds=(1, 2, 3, 4, 5),
    steps=1500,
    eval_every=250,
    documents=40000,
    heldout=200,
    greedy_limit=100,
)
# CI: that everything runs and the report is written (2 kinds x 2 seeds, 20 steps).
CI = Protocol(
    kinds=("mle", "del"),
    seeds=(1, 2),
    steps=20,
    eval_every=10,
    documents=1500,
    heldout=16,
    greedy_limit=8,
)


@dataclass(frozen=True)
class Run:
    kind: str
    seed: int
    directory: Path

    @property
    def done(self) -> bool:
        return (self.directory / "metrics.json").is_file()


def runs_of(protocol: Protocol, root: Path) -> list[Run]:
    return [
        Run(kind, seed, root / "runs" / f"{kind}-{seed}")
        for seed in protocol.seeds
        for kind in protocol.kinds
    ]


def check_root(protocol: Protocol, root: Path) -> None:
    """The root's runs were made by this protocol (or there are none yet): recorded in
    root/protocol.json at the first start."""
    record = root / "protocol.json"
    mine = protocol.fingerprint()
    if record.is_file():
        theirs = json.loads(record.read_text())
        if theirs != mine:
            changed = sorted(k for k in mine if theirs.get(k) != mine[k])
            raise UserError(
                f"{root} holds runs of another protocol ({', '.join(changed)} differ): "
                "choose another --root, or remove it to start again"
            )
        return
    write_text_atomic(record, json.dumps(mine, indent=1) + "\n")


def prepare_data(protocol: Protocol, root: Path) -> Path:
    """The task suite, its tokenizer and training shards under root/data, made once by the
    `data-tools` commands a user would type (docs/data.md)."""
    data = root / "data"
    ready = data / "ready"
    if ready.is_file():
        return data
    train, tokenizer = data / "tasks" / "train.jsonl", data / "tokenizer.model"
    suite = ["-o", data / "tasks", "--documents", protocol.documents]
    suite += ["--heldout", protocol.heldout, "--seed", protocol.data_seed]
    for arguments in (
        ["tasks", *suite],
        ["tokenizer", train, "-o", tokenizer, "--vocab-size", 1000],
        ["build", train, "-o", data / "shards", "--tokenizer", tokenizer, "--shard-mb", 1],
    ):
        command = [sys.executable, "-m", "data_tools", *map(str, arguments)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise UserError(f"{' '.join(command[2:4])} failed: {done.stderr.strip()[-2000:]}")
    ready.write_text("")
    return data


def train_command(protocol: Protocol, run: Run, data: Path) -> list[str]:
    """One process, tensor parallel 1 (runs go side by side, --jobs), checkpoints at the
    learning curves' steps, every one kept until evaluated."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "del_megatron.cli.train",
        "--config",
        str(REPOSITORY / protocol.config),
        f"loss.kind={run.kind}",
        f"train.seed={run.seed}",
        f"train.steps={protocol.steps}",
        f"train.save_interval={protocol.eval_every}",
        f"train.log_interval={protocol.eval_every}",
        f"data.tokenizer={data / 'tokenizer.model'}",
        f"data.sources=[{{manifest: {data / 'shards' / 'manifest.json'}}}]",
        f"output_dir={run.directory}",
    ]


def evaluate_command(protocol: Protocol, run: Run, data: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "experiments.numeric_tasks.run",
        "evaluate-run",
        str(run.directory),
        "--suite",
        str(data / "tasks"),
        "--greedy-limit",
        str(protocol.greedy_limit),
    ]


class Children:
    """The processes started for runs, ended when the experiment is stopped (a run of ours
    cut short is redone at the next start)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: set[subprocess.Popen] = set()
        self.stopping = False

    def run(self, command: list[str], log: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "ab") as out, self.lock:
            if self.stopping:
                raise UserError("stopped")
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
            self.running.add(process)
        code = process.wait()
        with self.lock:
            self.running.discard(process)
        if code != 0:
            tail = "".join(log.read_text(errors="replace").splitlines(True)[-20:])
            raise UserError(f"{' '.join(command[:6])} ... failed ({code}); {log} ends:\n{tail}")

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for process in self.running:
                process.terminate()


def train_and_evaluate(protocol: Protocol, run: Run, data: Path, children: Children) -> dict:
    """One run from nothing: trained, its checkpoints evaluated, metrics.json written, then
    every checkpoint but the last removed (runs/KIND-SEED holds what this wrote)."""
    if run.directory.exists():
        shutil.rmtree(run.directory)  # a run of ours cut short: start it again
    run.directory.mkdir(parents=True)
    started = time.monotonic()
    children.run(train_command(protocol, run, data), run.directory / "train.log")
    trained = time.monotonic()
    children.run(evaluate_command(protocol, run, data), run.directory / "evaluate.log")
    metrics = json.loads((run.directory / "metrics.json").read_text())
    checkpoints = sorted((run.directory / "checkpoints").glob("step-*"))
    for old in checkpoints[:-1]:
        shutil.rmtree(old)
    metrics["seconds"] = {"train": trained - started, "evaluate": time.monotonic() - trained}
    return metrics


def progress_line(done: int, total: int, run: Run, metrics: dict, eta_s: float) -> str:
    last = metrics["curve"][-1]
    by_level: dict[str, list[float]] = {}
    for task in last["tasks"].values():
        by_level.setdefault(task["level"], []).append(task["digit_acc"])
    accs = ", ".join(
        f"{level} digit acc {sum(v) / len(v):.3f}" for level, v in sorted(by_level.items())
    )
    s = metrics["seconds"]
    return (
        f"[{done}/{total}] {run.kind} seed {run.seed}: trained {s['train']:.0f} s, evaluated "
        f"{s['evaluate']:.0f} s; step {last['step']}: {accs}; about {eta_s / 60:.0f} min left"
    )


Worker = Callable[[Protocol, Run, Path, Children], dict]


def side_by_side(todo: list, one: Callable, jobs: int, children: Children) -> None:
    """`one(item)` for every item, `jobs` at a time. The main thread waits a second at a time
    (a signal is handled by that thread only) and, on any failure or stop, ends every child
    before the pool is shut down."""
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for future in [pool.submit(one, item) for item in todo]:
            while True:
                try:
                    future.result(timeout=1.0)
                    break
                except FuturesTimeout:
                    continue
    except BaseException:
        children.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_protocol(
    protocol: Protocol,
    root: Path,
    *,
    jobs: int = 1,
    worker: Worker = train_and_evaluate,
    data: Path | None = None,
    say: Callable[[str], None] = print,
) -> list[Run]:
    """Every run of `protocol` not yet done, `jobs` at a time; returns every run."""
    root.mkdir(parents=True, exist_ok=True)
    check_root(protocol, root)
    data = data or prepare_data(protocol, root)
    runs = runs_of(protocol, root)
    todo = [r for r in runs if not r.done]
    if len(todo) < len(runs):
        say(f"{len(runs) - len(todo)} of {len(runs)} runs already done, kept")
    children, lock = Children(), threading.Lock()
    started, finished = time.monotonic(), [len(runs) - len(todo)]

    def one(run: Run) -> None:
        if children.stopping:  # another run failed: start nothing more
            return
        try:
            metrics = worker(protocol, run, data, children)
        except BaseException:
            children.stop()  # before this thread takes the next run
            raise
        write_text_atomic(run.directory / "metrics.json", json.dumps(metrics, indent=1) + "\n")
        with lock:
            finished[0] += 1
            new = finished[0] - (len(runs) - len(todo))
            left = len(runs) - finished[0]
            eta = (time.monotonic() - started) / new * left  # `jobs` at a time, as so far
            say(progress_line(finished[0], len(runs), run, metrics, eta))

    side_by_side(todo, one, jobs, children)
    return runs


def evaluate_run(run_dir: Path, suite_dir: Path, greedy_limit: int) -> None:
    """Every checkpoint of one run evaluated on the suite (its Hugging Face export, made
    into a scratch directory; greedy answers at the last only): run_dir/metrics.json =
    {kind, seed, curve: [{step, tasks}]}.
    The loss kind and seed are read from the run's own config."""
    import tempfile

    import torch
    import yaml

    from del_megatron.evaluation.backends import load_model, max_positions
    from del_megatron.evaluation.task_suite import evaluate_suite, load_suite
    from del_megatron.models.conversion import export_hf

    suite = load_suite(suite_dir)
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    if not checkpoints:
        raise UserError(f"{run_dir}/checkpoints: no checkpoint to evaluate")
    config = yaml.safe_load((checkpoints[-1] / "run_config.yaml").read_text())
    curve = []
    for checkpoint in checkpoints:
        last = checkpoint == checkpoints[-1]  # greedy answers at the last step only (costly)
        with tempfile.TemporaryDirectory(prefix="task-eval-") as scratch:
            hf = Path(scratch) / "hf"
            export_hf(checkpoint, hf, dtype="float32")
            loaded = load_model(hf, torch.device("cpu"))
            tasks = evaluate_suite(
                loaded,
                suite,
                positions=max_positions(hf),
                scratch=Path(scratch),
                greedy_limit=greedy_limit if last else 0,
            )
        curve.append({"step": int(checkpoint.name.split("-")[1]), "tasks": tasks})
    metrics = {"kind": config["loss"]["kind"], "seed": config["train"]["seed"], "curve": curve}
    write_text_atomic(run_dir / "metrics.json", json.dumps(metrics, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["evaluate-run"]:
            p = argparse.ArgumentParser(prog="numeric_tasks evaluate-run")
            p.add_argument("run_dir", type=Path)
            p.add_argument("--suite", type=Path, required=True)
            p.add_argument("--greedy-limit", type=int, required=True)
            a = p.parse_args(argv[1:])
            evaluate_run(a.run_dir, a.suite, a.greedy_limit)
            return 0
        return experiment_main(argv)
    except UserError as err:
        print(f"numeric tasks: error: {err}", file=sys.stderr)
        return 2


def _stopped(signum, frame) -> None:
    print(
        "numeric tasks: stopped; the same command continues (finished runs are kept)",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + signum)  # run_protocol ends its children on the way out


def experiment_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="numeric_tasks", description=__doc__.splitlines()[0])
    p.add_argument("--ci", action="store_true", help="the short version CI runs")
    p.add_argument("--root", type=Path, help="runs and data (default runs/numeric-tasks[-ci])")
    p.add_argument("--out", type=Path, help="report, plots, raw metrics (default ROOT/report)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one core each)")
    p.add_argument("--kinds", nargs="+", choices=ALL_KINDS)
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--eval-every", type=int)
    a = p.parse_args(argv)
    protocol = CI if a.ci else FULL
    changes = {
        "kinds": tuple(a.kinds) if a.kinds else None,
        "seeds": tuple(a.seeds) if a.seeds else None,
        "steps": a.steps,
        "eval_every": a.eval_every,
    }
    protocol = replace(protocol, **{k: v for k, v in changes.items() if v is not None})
    from .report import BASELINE

    if BASELINE not in protocol.kinds:
        raise UserError(f"--kinds: the effects are differences to {BASELINE}; include it")
    root = a.root or Path("runs/numeric-tasks-ci" if a.ci else "runs/numeric-tasks")
    out = a.out or root / "report"
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _stopped)  # a kill ends the runs in flight too
    runs = run_protocol(protocol, root, jobs=a.jobs)
    from .report import read_runs, write_report

    command = "bash launch/experiments/numeric_tasks.sh " + " ".join(argv)
    written = write_report(
        read_runs(r.directory / "metrics.json" for r in runs),
        out,
        protocol=protocol.fingerprint() | {"kinds": protocol.kinds, "seeds": protocol.seeds},
        command=command.strip(),
        minutes=(time.monotonic() - started) / 60,
    )
    print(f"written: {written} ({(time.monotonic() - started) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
