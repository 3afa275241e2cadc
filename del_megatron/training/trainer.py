"""The training loop, top to bottom: shard -> batch -> model -> logits -> loss -> step.

Two engines run the step (train.engine): a plain loop (forward, loss hook, engine.backward,
engine.step) around a DeepSpeed engine, or megatron-core's own engine and schedules
(training/megatron_engine.py), which alone pipelines: megatron's schedules call
torch.autograd.backward themselves and would bypass DeepSpeed's.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import collectives
from ..config import ConfigError, RunConfig, deepspeed_config
from ..data import StreamingLoader
from ..errors import UserError
from ..models.device import (
    batch_to_device,
    deterministic_algorithms,
    peak_flops,
    recompute_overrides,
    resolve_device,
    select_accelerator,
)
from ..outputs import agreed_output_lock, close_on_the_way_out
from . import progress
from .initial_weights import initialize_weights, open_initial_weights
from .metrics import PairSum, Reporter, StepMetrics, derived_values, log_step, means
from .plan import flops_per_token
from .schedule import Schedule, reapply, rebase
from .signals import StopRequest, agree

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
    engine: Any
    scheduler: Any
    tokenizer: Any
    schedule: Schedule | None = None  # what the scheduler follows; saved with each checkpoint
    flops_per_token: float = 0.0
    peak_flops: float | None = None  # per device, for MFU (None: unknown device)
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0

    @property
    def dp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(cfg: RunConfig, schedule: Schedule | None = None) -> Run:
    """schedule: the learning-rate schedule (default: the config's; a resume passes the one
    `resume_changes.review` gives)."""
    device = resolve_device(cfg.train.device)
    select_accelerator(device)
    deterministic_algorithms(cfg.train.deterministic)
    from megatron.core import parallel_state

    from ..parallel import MegatronMPU, init_distributed, init_model_parallel
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
    common = {
        "cfg": cfg,
        "device": device,
        "rank": rank,
        "world": world,
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "dp_size": dp_size,
        "accumulation": accumulation,
        "tokenizer": tokenizer,
        "schedule": schedule,
        "flops_per_token": float(flops),
        "peak_flops": peak_flops(device),
    }
    if cfg.train.engine == "megatron":
        from . import megatron_engine

        chunks = build_stages(cfg, device, tokenizer)
        engine, lr_scheduler = megatron_engine.build(cfg, device, chunks, schedule)
        count = megatron_engine.parameter_count(engine, device)
        progress.model_built(cfg, count * cfg.parallel.tensor_parallel)
        return Run(engine=engine, scheduler=lr_scheduler, **common)
    model = build_model(cfg, device, tokenizer)
    params = sum(p.numel() for p in model.parameters()) * cfg.parallel.tensor_parallel
    progress.model_built(cfg, params)

    import deepspeed

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)

    engine, _, _, lr_scheduler = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(cfg, world, gpu=device.type == "cuda"),
        mpu=MegatronMPU(),
        lr_scheduler=scheduler,
    )
    return Run(engine=engine, scheduler=lr_scheduler, **common)


def build_model(
    cfg: RunConfig,
    device: torch.device,
    tokenizer,
    *,
    stage: tuple[bool, bool, int | None] = (True, True, None),
    seed_offset: int = 0,
    **overrides: Any,
) -> torch.nn.Module:
    """The run's model on `device` (megatron's parallel state initialized): built by the one
    builder (`models/llama.build_llama`: RNGs seeded with train.seed, megatron's random init
    skipped when initial weights load right after), the initial weights loaded, the EMO cost
    embedding frozen from them. stage: (pre_process, post_process, vp_stage) of a pipeline
    stage's model chunk (`megatron_engine.stage_flags`); seed_offset: added to train.seed
    (`build_stages`); overrides: TransformerConfig fields."""
    from ..models import build_llama

    initial = open_initial_weights(cfg)
    pre_process, post_process, vp_stage = stage
    model = build_llama(
        cfg.model,
        tokenizer.digit_vocab,
        cfg.loss,
        device,
        seed=cfg.train.seed + seed_offset,
        weights_follow=initial is not None,
        # both engines' backward is of loss_func's sum times one factor (DeepSpeed's
        # loss_sum * scale, megatron's grad_scale_func): the fused loss's backward scales
        # its gradient on the device, no host read
        promise_scaled_loss=True,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **recompute_overrides(device, cfg.train.activation_checkpointing),
        **overrides,
    )
    initialize_weights(cfg, model, initial)
    model.freeze_emo_cost_embedding()  # from the weights the run starts from
    return model


def build_stages(cfg: RunConfig, device: torch.device, tokenizer) -> list[torch.nn.Module]:
    """This rank's model chunks for megatron's engine: one per virtual stage of its pipeline
    stage, each with its layers (megatron numbers them from the stage's offset) and the
    initial weights of those layers. A random start seeds each chunk with train.seed +
    100 x its pipeline rank (Megatron-LM's offset) + its virtual stage, so no two chunks
    draw the same weights; the first chunk of the first stage, the whole model at PP 1,
    draws what the deepspeed engine's build draws."""
    from megatron.core import parallel_state

    from ..models.device import building_stages, pipeline_overrides
    from .megatron_engine import stage_flags, stage_overrides

    overrides = {
        **stage_overrides(cfg),
        **pipeline_overrides(device, cfg.parallel.pipeline_parallel),
    }
    chunks = []
    offset = 100 * parallel_state.get_pipeline_model_parallel_rank()
    for v, flags in enumerate(stage_flags(cfg.parallel.virtual_pipeline_parallel)):
        with building_stages(device):  # tied embeddings: the last stage's copy
            chunk = build_model(
                cfg, device, tokenizer, stage=flags, seed_offset=offset + v, **overrides
            )
        chunks.append(chunk)
    return chunks


def stage_reads_data(cfg: RunConfig) -> bool:
    """Whether this rank reads the training data (megatron's parallel state set): all of them
    but the pipeline stages between the first (tokens) and the last (labels, loss mask),
    which take activations only, as in Megatron-LM's get_batch."""
    if cfg.train.engine != "megatron" or cfg.parallel.pipeline_parallel == 1:
        return True
    from .megatron_engine import stage_flags

    flags = stage_flags(cfg.parallel.virtual_pipeline_parallel)
    return any(pre or post for pre, post, _ in flags)


def trace_file(cfg: RunConfig, dp_rank: int) -> str | None:
    """This rank's file of trained documents under data.trace (None: no trace), one per
    data-parallel rank, written by its first tensor-parallel rank of the first pipeline
    stage (its peers get the same batches)."""
    from pathlib import Path

    from megatron.core import parallel_state

    if cfg.data.trace is None or parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    if parallel_state.get_pipeline_model_parallel_rank() != 0:
        return None
    Path(cfg.data.trace).mkdir(parents=True, exist_ok=True)
    return str(Path(cfg.data.trace) / f"dp{dp_rank:05d}.jsonl")


def _forward(run: Run, batch: dict[str, torch.Tensor], probe: bool = False):
    """A micro-batch already on the compute device -> (loss sum, tokens, report pairs).
    probe: also measure the numeric term's share of the gradient at the output layer's
    logits (`NumericLossGPTModel.forward`'s `numeric_grad_probe`: the report then holds
    'numeric_grad_share' and 'numeric_grad_cos').

    The model's forward ends in its loss head (`NumericLossGPTModel._postprocess`) and
    returns the head's `NumericLossOutput`, read here from that return value. The head runs
    inside the engine's forward so that ZeRO 3 gathers the output weight for it (and again
    for its backward) as for any layer (docs/architecture.md, "Megatron adapter")."""
    from ..models import loss_func

    tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    positions = torch.arange(tokens.shape[1], device=run.device).expand_as(tokens)
    probed = {"numeric_grad_probe": True} if probe else {}
    output = run.engine(tokens, positions, None, labels=labels, loss_mask=loss_mask, **probed)
    return loss_func(loss_mask, output)


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

    def score(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if run.cfg.train.engine == "megatron":
            from . import megatron_engine

            return megatron_engine.score(run, batch)
        return _forward(run, batch)[2]  # {name: [sum, count]}

    synced = contextlib.nullcontext()
    if run.cfg.train.engine == "megatron":
        from .megatron_engine import synced_weights

        synced = synced_weights(run.engine)  # the last step's weights, gathered
    run.engine.eval()
    try:
        with torch.no_grad(), synced:
            evaluated = teacher_forced(
                loader, score, _pair_means, device=run.device, group=run.dp_group
            )
    finally:
        run.engine.train()
    return {**evaluated.metrics, **derived_values(evaluated.metrics, run.cfg.loss)}


def _pair_means(sums: dict[str, list[float]]) -> dict[str, float]:
    return means(list(sums), list(sums.values()))


def next_micro_batches(
    run: Run, source: Iterator[dict[str, torch.Tensor]] | BatchSource | None, step: int
) -> list[dict[str, torch.Tensor] | None]:
    """This rank's micro-batches of optimizer step `step` (0-based); None for each on a
    pipeline stage that reads no data (`stage_reads_data`)."""
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


def train_step(
    run: Run,
    micro_batches: list[dict[str, torch.Tensor]],
    step: int,
    stop: StopRequest | None = None,
    writing: bool = False,
) -> StepOutcome:
    """One optimizer step (`step` 1-based) over this rank's micro-batches (host tensors,
    as the loader gives them). `writing`: whether this rank's checkpoint writer is still at
    work, agreed with the stop signal (the outcome's `writing`).

    DeepSpeed: each micro-batch's summed loss is divided by the tokens of the whole global
    batch (all micro-batches of all data-parallel ranks), then multiplied back by what
    DeepSpeed divides by (accumulation steps, data-parallel averaging); megatron: its
    per-token loss (training/megatron_engine.py). Either way the step's gradient is that of
    sum(loss) / tokens over the global batch, whatever the parallel layout.

    Counts and metrics stay on the device; the step's one host synchronisation is the
    agreement on the stop signal and on a non-finite loss (`signals.agree`).
    """
    start = time.perf_counter()
    # the gradient probe on a log step's first micro-batch only (its cost: two more passes
    # of the loss op on it; no host read, its values read with the step's)
    probe = gradient_probe_due(run.cfg, step)
    if run.cfg.train.engine == "megatron":
        from . import megatron_engine

        done = megatron_engine.train_step(run, micro_batches, probe, stop, writing)
    else:
        done = _deepspeed_step(run, micro_batches, probe, stop, writing)
    _count_nonfinite(run, step, done.skipped)
    seconds = time.perf_counter() - start
    host = {
        "skipped_steps": float(run.nonfinite_total),
        "lr": run.scheduler.get_last_lr()[0],
        **throughput(run, seconds),
    }
    metrics = StepMetrics(done.names, done.pairs, done.grad_norm, host)
    agreed = done.agreed
    return StepOutcome(metrics=metrics, stop=agreed.stop, writing=agreed.writing, seconds=seconds)


def _deepspeed_step(
    run: Run,
    micro_batches: list[dict[str, torch.Tensor]],
    probe: bool,
    stop: StopRequest | None,
    writing: bool,
):
    """The step on the DeepSpeed engine: each micro-batch's forward, backward and step."""
    from .megatron_engine import EngineStep

    engine = run.engine
    micro_batches = [batch_to_device(b, run.device) for b in micro_batches]
    tokens = torch.stack([b["loss_mask"].sum() for b in micro_batches]).sum().double()
    collectives.all_reduce(tokens, group=run.dp_group)
    # a true division on the device, rounded once to the loss's float32 (as the host float
    # of a Python division would be), so no step waits for the count to reach the host
    scale = (tokens.new_full((), run.dp_size * run.accumulation) / tokens.clamp(min=1.0)).float()
    totals = PairSum()
    skipped_before = engine.skipped_steps
    for micro, batch in enumerate(micro_batches):
        loss_sum, _, report = _forward(run, batch, probe=probe and micro == 0)
        engine.backward(loss_sum * scale)
        engine.step()
        totals.add(report)
    local_loss = totals.totals["lm loss"][0]  # this rank's loss sum
    names, pairs = totals.reduced(run.dp_group)
    agreed = agree(stop, ~torch.isfinite(local_loss), writing)
    # The ZeRO optimizer skips a step whose gradient norm is not finite (NaN/inf loss
    # included): no update and no schedule step. Both signs are agreed by every rank (the
    # overflow check inside DeepSpeed, the loss flag in `agree`).
    skipped = engine.skipped_steps > skipped_before or agreed.nonfinite
    return EngineStep(names, pairs, engine.get_global_grad_norm(), agreed, skipped)


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
    from ..checkpoint import changes as resume_changes
    from ..checkpoint import directory, load
    from ..checkpoint import publish as publishing
    from ..checkpoint import save as saving

    # StopRequest first: a signal during set-up is a stop, not a kill
    with StopRequest() as stop, contextlib.ExitStack() as held:
        path = directory.resolve(resume, cfg.output_dir)
        save = save and cfg.train.checkpoints
        changes = resume_changes.review(path, cfg, resume) if path is not None else None
        for line in changes.lines if changes else []:
            progress.say(line)
        run = setup(cfg, changes.schedule if changes else None)
        # one job writes an output_dir: a second is refused on every rank (outputs.py)
        held.enter_context(agreed_output_lock(Path(cfg.output_dir), leader=run.is_main))
        loader = None
        if batches is None and stage_reads_data(cfg):
            loader = StreamingLoader(
                cfg.data_config(),
                run.dp_rank,
                run.dp_size,
                fingerprint=run.tokenizer.fingerprint,
                trace=trace_file(cfg, run.dp_rank),
            )
        result = TrainResult()
        start = 0
        if run.is_main:
            directory.remove_partial(cfg.output_dir)
        if path is not None:
            progress.say(f"loading {path}")
            start = load.load(run, path, loader)
            if changes.peak_changed:  # the saved state holds the old peak and its rate
                rebase(run.scheduler, cfg.optim.lr)
            elif changes.schedule_changed:  # ... the old schedule's rate at this position
                reapply(run.scheduler)
            if run.is_main:
                print(f"resumed from {path} at step {start}", flush=True)
        source = iter(loader) if loader is not None else batches
        last = cfg.train.steps
        reporter = Reporter(cfg, start=start, enabled=run.is_main)

        pending: saving.PendingSave | None = None  # a checkpoint being written

        def keep(step: int) -> None:
            """Start the checkpoint of `step`, once the one before it is published (a save
            waits for the previous one: at most one in flight)."""
            nonlocal pending
            if save:
                publish()
                pending = saving.save(run, step, loader, keep=cfg.train.keep_checkpoints)
                if not pending.background:  # written already: no step between
                    publish()

        def publish(run_ends: bool = False) -> None:
            """Make the checkpoint being written one (every rank, at the same step) and say
            how long training waited for it; `run_ends` after it: old checkpoints are
            deleted before it returns."""
            nonlocal pending
            if pending is not None:
                started = time.perf_counter()
                saved = publishing.publish(run, pending, run_ends=run_ends)
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
                outcome = train_step(run, batches_of_step, step, stop, writing)
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
