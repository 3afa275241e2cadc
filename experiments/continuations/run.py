"""The continuation experiment (launch/experiments/continuations.sh): can DEL move a model that
MLE has already trained, and by how much, against what a trivial nudge does?

Shared bases: one MLE run per seed to `base_steps` on the numeric task suite (the numeric-task
protocol's data, model and schedule, `numeric_tasks.run`). Then every arm continues each base
for `steps` from its weights (a fresh optimizer, as continued pretraining starts from a
released model), all arms of one base on the same data order (data.seed per base) and
schedule: MLE, a placebo (MLE at lr x1.1), DEL at alpha in {0.1, 0.3, 1, 3}, the
shift-invariant DEL (`loss.shift_invariant`, ours) at the same alphas, DIST2 0.1 and NTL
(Wasserstein) 0.3. Each continuation's last checkpoint is evaluated per task (greedy answers
too: number MAE), and its training metrics every `log_every` steps (the digit logits' level,
the term) are kept with it. The analysis is fixed in advance (`report`:
PRIMARY endpoints, each a trend in log alpha, Holm-corrected).

    python -m experiments.continuations.run [--ci] [--root DIR] [--out DIR]
        [--jobs N]

Resumable: a run is done when its metrics.json exists (written atomically once evaluated);
a run without it was cut short and starts again. Runs of another protocol in the same root
are refused. One progress line per finished run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from del_megatron.errors import UserError
from del_megatron.outputs import write_text_atomic

from .. import REPOSITORY
from ..numeric_tasks.run import CONFIG, Children, check_root, prepare_data, side_by_side


@dataclass(frozen=True)
class Arm:
    """One continuation: its name (as the report names it) and the config overrides."""

    name: str
    kind: str
    alpha: float | None = None
    shift_invariant: bool = False
    lr_scale: float = 1.0
    family: str = ""
    """The dose-response family the arm belongs to (the report's trends); '' for the rest."""

    def overrides(self, lr: float, min_lr: float) -> list[str]:
        out = [f"loss.kind={self.kind}"]
        if self.alpha is not None:
            out.append(f"loss.alpha={self.alpha}")
        if self.shift_invariant:
            out.append("loss.shift_invariant=true")
        out += [f"optim.lr={lr * self.lr_scale}", f"optim.min_lr={min_lr * self.lr_scale}"]
        return out


ALPHAS = (0.1, 0.3, 1.0, 3.0)
ARMS = (
    Arm("mle", "mle"),
    Arm("placebo", "mle", lr_scale=1.1),
    *(Arm(f"del-{a:g}", "del", alpha=a, family="del") for a in ALPHAS),
    *(
        Arm(f"del_si-{a:g}", "del", alpha=a, shift_invariant=True, family="del_shift_invariant")
        for a in ALPHAS
    ),
    Arm("dist2-0.1", "dist2", alpha=0.1),
    Arm("ntl_was-0.3", "ntl_was", alpha=0.3),
)


@dataclass(frozen=True)
class Protocol:
    seeds: tuple[int, ...]
    base_steps: int
    steps: int  # of each continuation
    log_every: int  # training metrics of a continuation every this many steps
    documents: int
    heldout: int
    greedy_limit: int
    lr: float = 1.0e-3  # the continuations' peak (cosine to min_lr, 5% warm-up)
    min_lr: float = 1.0e-4
    data_seed: int = 0  # of the task suite
    config: str = CONFIG
    arms: tuple[Arm, ...] = field(default=ARMS)
    long_seeds: tuple[int, ...] = ()
    """Bases also continued `long_steps` by every arm (whether anything emerges later)."""
    long_steps: int = 0

    def fingerprint(self) -> dict:
        """What makes two experiments' runs the same runs, as protocol.json holds it."""
        same = json.loads(json.dumps(asdict(self)))
        if not self.long_seeds:  # as before these fields existed: older roots still resume
            del same["long_seeds"], same["long_steps"]
        return same


# ~75 core-minutes: 4 bases x 1000 steps + 4 x 12 continuations x 300 steps, evaluated.
FULL = Protocol(
    seeds=(1, 2, 3, 4),
    base_steps=1000,
    steps=300,
    log_every=25,
    documents=40000,
    heldout=200,
    greedy_limit=100,
)
# CI: that everything runs and the report is written (2 bases, 3 arms: the control and both
# DEL forms at the largest alpha, where the escape shows within 10 steps).
CI = Protocol(
    seeds=(1, 2),
    base_steps=20,
    steps=10,
    log_every=5,
    documents=1500,
    heldout=16,
    greedy_limit=8,
    arms=(ARMS[0], ARMS[5], ARMS[9]),
)


@dataclass(frozen=True)
class Run:
    arm: Arm | None  # None: a base
    seed: int
    directory: Path
    steps: int | None = None
    """A continuation's own length (`Protocol.long_steps`); None: the protocol's `steps`."""

    @property
    def kind(self) -> str:
        """As the raw rows name it: the arm, and its length where that is not the protocol's
        (`mle@1000`), so that rows of two lengths of one arm and base stay apart."""
        if self.arm is None:
            return "base"
        return self.arm.name if self.steps is None else f"{self.arm.name}@{self.steps}"

    @property
    def name(self) -> str:
        return f"base-{self.seed}" if self.arm is None else f"{self.kind} seed {self.seed}"

    @property
    def done(self) -> bool:
        """Evaluated and recorded (`seconds` is written last: evaluate-run's metrics.json
        alone is a run cut short between the two writes)."""
        try:
            return "seconds" in json.loads((self.directory / "metrics.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False


def bases_of(protocol: Protocol, root: Path) -> list[Run]:
    return [Run(None, s, root / "bases" / f"mle-{s}") for s in protocol.seeds]


def continuations_of(protocol: Protocol, root: Path) -> list[Run]:
    """Seed by seed, so that a partial experiment has every arm of its first seeds; the long
    continuations last."""
    return [
        Run(arm, s, root / "runs" / f"{arm.name}-{s}")
        for s in protocol.seeds
        for arm in protocol.arms
    ] + [
        Run(arm, s, root / "runs" / f"{arm.name}-{s}-{protocol.long_steps}", protocol.long_steps)
        for s in protocol.long_seeds
        for arm in protocol.arms
    ]


def base_checkpoint(protocol: Protocol, root: Path, seed: int) -> Path:
    return root / "bases" / f"mle-{seed}" / "checkpoints" / f"step-{protocol.base_steps:07d}"


def train_command(protocol: Protocol, run: Run, data: Path, root: Path) -> list[str]:
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "del_megatron.cli.train",
        "--config",
        str(REPOSITORY / protocol.config),
        # train.seed sets the initial weights and the data order: a continuation's weights
        # are its base's, its data order one per base (the same for every arm)
        f"train.seed={run.seed if run.arm is None else 2000 + run.seed}",
        f"data.tokenizer={data / 'tokenizer.model'}",
        f"data.sources=[{{manifest: {data / 'shards' / 'manifest.json'}}}]",
        f"output_dir={run.directory}",
    ]
    if run.arm is None:
        steps = protocol.base_steps
        return [*common, "loss.kind=mle", f"train.steps={steps}", f"train.save_interval={steps}"]
    steps = run.steps or protocol.steps
    return [
        *common,
        *run.arm.overrides(protocol.lr, protocol.min_lr),
        f"init.megatron={base_checkpoint(protocol, root, run.seed)}",
        f"train.steps={steps}",
        f"train.save_interval={steps}",
        f"train.log_interval={protocol.log_every}",
    ]


TRAIN_KEYS = (
    "loss",
    "ce",
    "numeric",
    "digit_entropy",
    "digit_acc",
    "digit_logit",
    "digit_logsumexp",
    "numeric_share",
    "numeric_grad_share",
    "numeric_grad_cos",
    "grad_norm",
)


def train_curve(run_dir: Path) -> list[dict]:
    """The training metrics of every logged step (metrics.jsonl), the keys that matter here."""
    rows = []
    path = run_dir / "metrics.jsonl"
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} line {number}: not JSON ({err})") from None
        rows.append({"step": record["step"], **{k: record[k] for k in TRAIN_KEYS if k in record}})
    return rows


def train_and_evaluate(
    protocol: Protocol, run: Run, data: Path, root: Path, children: Children
) -> dict:
    if run.directory.exists():
        shutil.rmtree(run.directory)  # a run of ours cut short: start it again
    run.directory.mkdir(parents=True)
    started = time.monotonic()
    command = train_command(protocol, run, data, root)
    children.run(command, run.directory / "train.log")
    trained = time.monotonic()
    evaluate = [
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
    children.run(evaluate, run.directory / "evaluate.log")
    metrics = json.loads((run.directory / "metrics.json").read_text())
    arm = run.arm
    metrics.update(
        kind=run.kind,
        seed=run.seed,  # the base's (a continuation's train.seed is its data order's)
        loss_kind=arm.kind if arm else "mle",
        family=arm.family if arm else "",
        alpha=arm.alpha if arm and arm.alpha is not None else math.nan,
        train_curve=train_curve(run.directory),
        seconds={"train": trained - started, "evaluate": time.monotonic() - trained},
    )
    if arm is not None:  # the continuations' checkpoints are not needed once evaluated
        shutil.rmtree(run.directory / "checkpoints")
    return metrics


def progress_line(done: int, total: int, run: Run, metrics: dict, eta_s: float) -> str:
    tasks = metrics["curve"][-1]["tasks"]
    hard = [t["digit_acc"] for t in tasks.values() if t["level"] == "hard"]
    s = metrics["seconds"]
    level = metrics["train_curve"][-1].get("digit_logsumexp", math.nan)
    return (
        f"[{done}/{total}] {run.name}: trained {s['train']:.0f} s, evaluated "
        f"{s['evaluate']:.0f} s; hard tasks' digit acc {sum(hard) / max(len(hard), 1):.3f}, "
        f"digit log-sum-exp {level:.2f}; about {eta_s / 60:.0f} min left"
    )


def run_all(protocol: Protocol, root: Path, *, jobs: int, say=print) -> list[Run]:
    """The bases, then every continuation, `jobs` at a time; returns the continuations."""
    root.mkdir(parents=True, exist_ok=True)
    check_root(protocol, root)
    data = prepare_data(protocol, root)
    bases, continuations = bases_of(protocol, root), continuations_of(protocol, root)
    every = bases + continuations
    todo = [r for r in every if not r.done]
    if len(todo) < len(every):
        say(f"{len(every) - len(todo)} of {len(every)} runs already done, kept")
    children, lock = Children(), threading.Lock()
    started, finished = time.monotonic(), [len(every) - len(todo)]
    # the work of a run, in base steps (a continuation also loads and is evaluated)
    cost = {
        id(r): (protocol.base_steps if r.arm is None else r.steps or protocol.steps) for r in every
    }
    left = [sum(cost[id(r)] for r in todo)]
    spent = [0]

    def one(run: Run) -> None:
        if children.stopping:
            return
        try:
            metrics = train_and_evaluate(protocol, run, data, root, children)
        except BaseException:
            children.stop()
            raise
        write_text_atomic(run.directory / "metrics.json", json.dumps(metrics, indent=1) + "\n")
        with lock:
            finished[0] += 1
            spent[0] += cost[id(run)]
            left[0] -= cost[id(run)]
            eta = (time.monotonic() - started) / spent[0] * left[0]
            say(progress_line(finished[0], len(every), run, metrics, eta))

    for stage in (bases, continuations):  # a continuation needs its base
        side_by_side([r for r in stage if not r.done], one, jobs, children)
    return continuations


def _stopped(signum, frame) -> None:
    print(
        "stopped; the same command continues (finished runs are kept)",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(128 + signum)


@dataclass(frozen=True)
class Experiment:
    """An experiment made of bases and their continuations: this one, or another protocol on
    the same machinery (`experiments.confirmatory`)."""

    name: str  # runs/NAME[-ci], the messages' prefix
    script: str  # the launcher that runs it, as the page names the command
    full: Protocol
    ci: Protocol
    write_report: Callable[..., Path]
    """(runs, out, *, protocol, command, minutes) -> report.md: raw rows, protocol.json, page."""


def experiment_main(experiment: Experiment, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=experiment.name, description=__doc__.splitlines()[0])
    p.add_argument("--ci", action="store_true", help="the short version CI runs")
    p.add_argument("--root", type=Path, help=f"runs and data (default runs/{experiment.name})")
    p.add_argument("--out", type=Path, help="report, plots, raw rows (default ROOT/report)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (one core each)")
    a = p.parse_args(argv)
    protocol = experiment.ci if a.ci else experiment.full
    root = a.root or Path(f"runs/{experiment.name}" + ("-ci" if a.ci else ""))
    out = a.out or root / "report"
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _stopped)
    try:
        runs = run_all(protocol, root, jobs=a.jobs)
        metrics = [json.loads((r.directory / "metrics.json").read_text()) for r in runs]
        bases = [
            json.loads((b.directory / "metrics.json").read_text()) for b in bases_of(protocol, root)
        ]
        command = (f"bash {experiment.script} " + " ".join(argv)).strip()
        written = experiment.write_report(
            bases + metrics,
            out,
            protocol=protocol.fingerprint(),
            command=command,
            minutes=(time.monotonic() - started) / 60,
        )
    except UserError as err:
        print(f"{experiment.name}: error: {err}", file=sys.stderr)
        return 2
    print(f"written: {written} ({(time.monotonic() - started) / 60:.1f} min)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .report import write_report

    experiment = Experiment(
        "continuations", "launch/experiments/continuations.sh", FULL, CI, write_report
    )
    return experiment_main(experiment, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
