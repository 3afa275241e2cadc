"""The training loop, top to bottom: shard -> batch -> model -> logits -> loss -> step.

The run's engine (train.engine: training/engines/, one module each, behind
`engines.EngineKind`) builds the model and its optimizer and runs each step; this loop
names none of them: it asks the run's kind (`Run.engine_kind`) to build, step, score and
hand its checkpoint adapter (training/checkpointing.py).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import watchdog
from ..checkpoint.layout import Place
from ..config import ConfigError, RunConfig
from ..data import StreamingLoader
from ..errors import UserError
from ..locks import LockLost
from ..outputs import agreed_output_lock, close_on_the_way_out, lock_lost, lost_lock_line
from ..runtime import deterministic_algorithms, peak_flops, resolve_device, select_accelerator
from . import progress
from .engines import EngineKind, kind_of
from .metrics import Reporter, StepMetrics, derived_values, log_step, means
from .plan import flops_per_token
from .schedule import Schedule, reapply, rebase
from .signals import StopRequest

BatchSource = Callable[[int, int], dict[str, torch.Tensor]]  # (step, micro) -> batch


class NonFiniteError(UserError, RuntimeError):
    """Too many optimizer steps in a row with non-finite loss or gradients."""


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # global loss of each step
    eval_before: dict[str, float] | None = None
    eval_after: dict[str, float] | None = None
    checkpoint: str | None = None
    stopped: bool = False  # a stop signal ended the run early (checkpoint saved)


@dataclass
class Run:
    """What the loop works with, built once by `setup`."""

    cfg: RunConfig
    device: torch.device
    rank: int
    world: int
    dp_rank: int
    dp_size: int
    accumulation: int
    engine_kind: EngineKind  # train.engine's component (training/engines/)
    engine: Any  # what it built and steps (DeepSpeed's engine, megatron's chunks)
    scheduler: Any
    tokenizer: Any
    place: Place  # this rank's place in the layout (tensor, pipeline, data-parallel ranks)
    schedule: Schedule | None = None  # what the scheduler follows; saved with each checkpoint
    flops_per_token: float = 0.0
    peak_flops: float | None = None  # per device, for MFU (None: unknown device)
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0

    @property
    def dp_group(self):
        return self.place.dp_group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(cfg: RunConfig, schedule: Schedule | None = None) -> Run:
    """schedule: the learning-rate schedule (default: the config's; a resume passes the one
    `resume_changes.review` gives)."""
    device = resolve_device(cfg.train.device)
    select_accelerator(device, cfg.parallel.tensor_parallel)
    deterministic_algorithms(cfg.train.deterministic)
    from ..parallel import init_distributed, init_model_parallel
    from ..tokenizer import Tokenizer

    timeout = cfg.parallel.collective_timeout_minutes
    rank, world = init_distributed(device, timeout)
    dp_size = cfg.data_parallel_size(world)
    accumulation = cfg.accumulation_steps(world)
    init_model_parallel(
        cfg.parallel.tensor_parallel,
        timeout,
        cfg.parallel.pipeline_parallel,
        cfg.parallel.virtual_pipeline_parallel,
    )
    tokenizer = Tokenizer(cfg.tokenizer_path())
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
            f"tokenizer's {tokenizer.vocab_size} tokens"
        )
    schedule = schedule or Schedule.of_config(cfg)
    flops = flops_per_token(cfg.model, cfg.parallel.tensor_parallel, cfg.train.seq_len)
    kind = kind_of(cfg.train.engine)
    here = _place(rank, world)
    built = kind.build(cfg, device, tokenizer, schedule, world)
    return Run(
        cfg=cfg,
        device=device,
        rank=rank,
        world=world,
        dp_rank=here.dp_rank,
        dp_size=dp_size,
        accumulation=accumulation,
        engine_kind=kind,
        engine=built.engine,
        scheduler=built.scheduler,
        tokenizer=tokenizer,
        place=here,
        schedule=schedule,
        flops_per_token=float(flops),
        peak_flops=peak_flops(device),
    )


def _place(rank: int, world: int) -> Place:
    """This rank's place from megatron-core's parallel state (set by `setup`): what the
    checkpoint package is handed instead of the parallel state itself."""
    from megatron.core import parallel_state

    return Place(
        rank=rank,
        world=world,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_group=parallel_state.get_data_parallel_group(),
    )


def trace_file(run: Run) -> str | None:
    """This rank's file of trained documents under data.trace (None: no trace), one per
    data-parallel rank, written by the rank that saves its data state (its peers get the
    same batches: `Place.writes_data_state`)."""
    trace = run.cfg.data.trace
    if trace is None or not run.place.writes_data_state:
        return None
    Path(trace).mkdir(parents=True, exist_ok=True)
    return str(Path(trace) / f"dp{run.dp_rank:05d}.jsonl")


def evaluate(run: Run, max_batches: int) -> dict[str, float] | None:
    """Loss and digit metrics on the held-out sources, one pass in file order: the one
    teacher-forced loop (`evaluation.pipeline`) scoring with the training forward, means of
    its [sum, count] pairs over every rank of the data-parallel group."""
    from ..evaluation.pipeline import teacher_forced

    if not run.cfg.eval.sources:
        return None
    loader = StreamingLoader(
        run.cfg.data_config(held_out=True),
        run.dp_rank,
        run.dp_size,
        fingerprint=run.tokenizer.fingerprint,
        num_batches=max_batches,
    )

    def score(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        with watchdog.waiting("the held-out evaluation's forward passes (and PP p2p)"):
            return run.engine_kind.score(run, batches)  # {name: [sum, count]}

    run.engine.eval()
    try:  # the last step's weights, gathered where the engine gathers them behind the step
        with torch.no_grad(), run.engine_kind.evaluation_weights(run.engine):
            evaluated = teacher_forced(
                groups(loader, run.accumulation), score, _pair_means,
                device=run.device, group=run.dp_group,
            )  # fmt: skip
    finally:
        run.engine.train()
    return {**evaluated.metrics, **derived_values(evaluated.metrics, run.cfg.loss)}


def groups(batches: Iterable[dict], size: int) -> Iterator[list[dict]]:
    """`batches` in lists of `size` (the last one shorter): a training step's worth of
    held-out micro-batches per engine call."""
    group: list[dict] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _pair_means(sums: dict[str, list[float]]) -> dict[str, float]:
    return means(list(sums), list(sums.values()))


def next_micro_batches(
    run: Run, source: Iterator[dict[str, torch.Tensor]] | BatchSource | None, step: int
) -> list[dict[str, torch.Tensor] | None]:
    """This rank's micro-batches of optimizer step `step` (0-based); None for each on a
    pipeline stage that reads no data (`EngineKind.reads_data`)."""
    if source is None:
        return [None] * run.accumulation
    if callable(source):
        return [source(step, m) for m in range(run.accumulation)]
    return [next(source) for _ in range(run.accumulation)]


@dataclass
class StepOutcome:
    metrics: StepMetrics  # on the compute device until read
    stop: bool  # agreed by every rank: a stop signal reached some rank
    writing: bool  # agreed: some rank's checkpoint writer has not finished
    seconds: float  # the step's time, to the agreement (which waits for the device)
    lost: bool = False  # agreed: the output's lock was taken over (rank 0 found it)


def train_step(
    run: Run,
    micro_batches: list[dict[str, torch.Tensor]],
    step: int,
    stop: StopRequest | None = None,
    writing: bool = False,
    lost: bool = False,
) -> StepOutcome:
    """One optimizer step (`step` 1-based) over this rank's micro-batches (host tensors,
    as the loader gives them). `writing`: whether this rank's checkpoint writer is still at
    work, agreed with the stop signal (the outcome's `writing`); `lost`: whether this rank
    found the output's lock taken over (agreed: the outcome's `lost`).

    The engine takes the step (`EngineKind.step`): every engine's gradient is that of
    sum(loss) / tokens over the global batch, whatever the parallel layout (DeepSpeed's:
    training/engines/deepspeed.py; megatron's per-token loss: training/engines/megatron.py).

    Counts and metrics stay on the device; the step's one host synchronisation is the
    agreement on the stop signal and on a non-finite loss (`signals.agree`).
    """
    start = time.perf_counter()
    # the gradient probe on a log step's first micro-batch only (its cost: two more passes
    # of the loss op on it; no host read, its values read with the step's)
    probe = gradient_probe_due(run.cfg, step)
    # its forward, backward, PP p2p and optimizer collectives, said by the watchdog if stuck
    with watchdog.waiting(watchdog.STEP_OPERATION, of=f"step {step}"):
        done = run.engine_kind.step(run, micro_batches, probe, stop, writing, lost)
    _count_nonfinite(run, step, done.skipped)
    seconds = time.perf_counter() - start
    host = {
        "skipped_steps": float(run.nonfinite_total),
        "lr": run.scheduler.get_last_lr()[0],
        **throughput(run, seconds),
    }
    metrics = StepMetrics(done.names, done.pairs, done.grad_norm, host)
    agreed = done.agreed
    return StepOutcome(
        metrics=metrics,
        stop=agreed.stop,
        writing=agreed.writing,
        seconds=seconds,
        lost=agreed.lost,
    )


def _count_nonfinite(run: Run, step: int, skipped: bool) -> None:
    """Count the skipped steps (non-finite loss or gradients); stop after too many in a
    row."""
    if not skipped:
        run.nonfinite_in_a_row = 0
        return
    run.nonfinite_in_a_row += 1
    run.nonfinite_total += 1
    if run.is_main:
        print(
            f"step {step}: non-finite loss or gradients, step skipped "
            f"({run.nonfinite_in_a_row} in a row, {run.nonfinite_total} in all)",
            flush=True,
        )
    if run.nonfinite_in_a_row >= run.cfg.train.max_nonfinite_steps:
        raise NonFiniteError(
            f"{run.nonfinite_in_a_row} optimizer steps in a row (up to step {step}) "
            "had non-finite loss or gradients; lower optim.lr, check the data, or raise "
            "train.max_nonfinite_steps"
        )


def gradient_probe_due(cfg: RunConfig, step: int) -> bool:
    """Whether step `step` measures the numeric term's gradient share: a log step (the
    console line's) of a kind with a digit term, unless the output layer is fused with the
    loss (`loss.fused_output`: the logits it is measured on never exist)."""
    loss = cfg.loss
    if loss.kind_spec.digit_term is None or loss.fused_output:
        return False
    return log_step(step, cfg.train.log_interval, cfg.train.steps)


def throughput(run: Run, seconds: float) -> dict[str, float]:
    """tokens/s of the whole run; on GPU also TFLOP/s per device and MFU (against the
    device's bf16 dense peak). `seconds` ends at a synchronisation, so it is device time."""
    values = {"tokens_per_s": run.cfg.train.global_batch_size * run.cfg.train.seq_len / seconds}
    if run.device.type == "cuda":
        per_device = run.flops_per_token * values["tokens_per_s"] / run.world
        values["tflops"] = per_device / 1e12
        if run.peak_flops:
            values["mfu"] = per_device / run.peak_flops
    return values


def due(interval: int, step: int, last: int) -> bool:
    """Every `interval` steps (0: never), not at the last step (handled on its own)."""
    return bool(interval) and step % interval == 0 and step < last


def train(
    cfg: RunConfig, *, batches: BatchSource | None = None, save: bool = True, resume: str = "none"
) -> TrainResult:
    """The whole run: setup, resume, evaluation before, the steps, checkpoints, evaluation
    after. resume: 'none', 'auto' (the newest complete checkpoint, if any) or a directory.

    A stop signal (SIGTERM, SIGUSR1) on any rank: every rank saves the checkpoint of the step
    just finished and returns with `stopped` set (no final save, no evaluation after).
    """
    from ..checkpoint import directory
    from ..checkpoint.save import PendingSave
    from . import checkpointing, resume_changes

    # StopRequest first: a signal during set-up is a stop, not a kill
    with StopRequest() as stop, contextlib.ExitStack() as held:
        path = directory.resolve(resume, cfg.output_dir)
        save = save and cfg.train.checkpoints
        changes = resume_changes.review(path, cfg, resume) if path is not None else None
        for line in changes.lines if changes else []:
            progress.say(line)
        run = setup(cfg, changes.schedule if changes else None)
        held.enter_context(watchdog.watching(
            rank=run.rank, world=run.world, stall_s=cfg.parallel.stall_seconds,
            continues_from=lambda: directory.resolve("auto", cfg.output_dir) or path,
        ))  # fmt: skip
        # one job writes an output_dir: a second is refused on every rank (outputs.py)
        held.enter_context(agreed_output_lock(Path(cfg.output_dir), leader=run.is_main))
        loader = None
        if batches is None and run.engine_kind.reads_data(cfg):
            loader = StreamingLoader(
                cfg.data_config(),
                run.dp_rank,
                run.dp_size,
                fingerprint=run.tokenizer.fingerprint,
                trace=trace_file(run),
            )
        result = TrainResult()
        start = 0
        if run.is_main:
            directory.remove_partial(cfg.output_dir, resume, path)  # and a fenced job's late ones
        if path is not None:
            progress.say(f"loading {path}")
            start = checkpointing.load(run, path, loader)
            if changes.peak_changed:  # the saved state holds the old peak and its rate
                rebase(run.scheduler, cfg.optim.lr)
            elif changes.schedule_changed:  # ... the old schedule's rate at this position
                reapply(run.scheduler)
            if run.is_main:
                print(f"resumed from {path} at step {start}", flush=True)
        source = iter(loader) if loader is not None else batches
        last = cfg.train.steps
        reporter = Reporter(cfg, start=start, enabled=run.is_main)

        pending: PendingSave | None = None  # a checkpoint being written

        def keep(step: int) -> None:
            """Start the checkpoint of `step`, once the one before it is published (a save
            waits for the previous one: at most one in flight)."""
            nonlocal pending
            if save:
                publish()
                with watchdog.waiting("saving the checkpoint (its gathers and host copies)",
                                      of=f"step {step}"):  # fmt: skip
                    pending = checkpointing.save(run, step, loader, keep=cfg.train.keep_checkpoints)
                if not pending.background:  # written already: no step between
                    publish()

        def publish(run_ends: bool = False) -> None:
            """Make the checkpoint being written one (every rank, at the same step) and say
            how long training waited for it; `run_ends` after it: old checkpoints are
            deleted before it returns."""
            nonlocal pending
            if pending is not None:
                started = time.perf_counter()
                with watchdog.waiting("publishing the checkpoint (every rank's files written)"):
                    saved = checkpointing.publish(run, pending, run_ends=run_ends)
                waited = pending.waited_s + time.perf_counter() - started
                reporter.message(f"checkpoint {saved.name} saved (training waited {waited:.2f} s)")
                result.checkpoint = str(saved)
                pending = None

        def report(flushed: list[tuple[int, dict[str, float]]]) -> None:
            result.losses.extend(values["loss"] for _, values in flushed)

        try:
            if start == 0:
                progress.held_out(cfg, "before training")
                result.eval_before = evaluate(run, cfg.eval.max_batches)
            progress.steps(cfg, start)
            for step in range(start + 1, last + 1):
                batches_of_step = next_micro_batches(run, source, step - 1)
                writing = pending is not None and not pending.writing.written()
                # the lock's record read by rank 0 before each step, its answer agreed in the
                # step's one host read: a job whose lock was taken over stops on every rank
                # before it writes a metrics line or a checkpoint more (outputs.py, "Fencing")
                lost = run.is_main and lock_lost(Path(cfg.output_dir))
                outcome = train_step(run, batches_of_step, step, stop, writing, lost)
                if outcome.lost:
                    raise LockLost(lost_lock_line(Path(cfg.output_dir), leader=run.is_main))
                if pending is not None and not outcome.writing:  # every rank's files written
                    publish()
                extra = {}
                if due(cfg.train.eval_interval, step, last):
                    held_out = evaluate(run, cfg.eval.max_batches) or {}
                    extra = {f"eval/{k}": v for k, v in held_out.items()}
                report(reporter.step(step, outcome.metrics, extra))
                if outcome.stop:  # the one place the stop decision is read
                    report(reporter.flush())
                    keep(step)
                    publish(run_ends=True)
                    reporter.message(f"stop requested: checkpoint of step {step} saved")
                    result.stopped = True
                    return result
                if due(cfg.train.save_interval, step, last):
                    report(reporter.flush())  # a resume from it finds every line up to it
                    keep(step)
            report(reporter.flush())
            if start < last:
                keep(last)
            publish(run_ends=True)
            if start >= last and path is not None:
                reporter.message(f"{path} is the last step ({last}): nothing left to train")
                result.checkpoint = str(path)
            progress.held_out(cfg, "after training")
            result.eval_after = evaluate(run, cfg.eval.max_batches)
            if result.eval_after is not None:
                reporter.log({f"eval/{k}": v for k, v in result.eval_after.items()}, last)
            return result
        finally:  # a failing run's closing adds no error of its own (a full disk: issue 37)
            failing = sys.exc_info()[1] is not None
            close_on_the_way_out(reporter.close, Path(cfg.output_dir), failing=failing)
