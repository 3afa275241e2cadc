"""megatron-core's own engine (train.engine=megatron): this rank's pipeline stage as model
chunks (one per virtual stage, `build_stages`) wrapped in megatron-core's
DistributedDataParallel, its optimizer, and one step as Megatron-LM's `train_step` takes it,
through `get_forward_backward_func()` (no pipelining, 1F1B, interleaved 1F1B). Everything of
this engine is here (`KIND`, training/engines/__init__.EngineKind): its config rules, its
device choices, its stages, its memory plan; its checkpoint adapter beside it
(megatron_checkpoint.py).

The step's gradient is that of sum(loss) / tokens over the global batch, as the deepspeed
engine's: megatron's per-token loss (`calculate_per_token_loss`), whose schedules sum the
micro-batches' loss sums and whose `finalize_model_grads` divides the gradients by the
global batch's token count (all-reduced over data-parallel ranks, sent from the last stage).
A step with a non-finite loss or gradient norm, agreed by every rank, is skipped as the ZeRO
optimizer skips it (no update, no schedule step).

The engine's choices (the distributed optimizer, overlapped reduce and gather, bf16) are the
config's, on with CUDA where unset (`engine_choices`), so a CPU run can take a GPU run's;
what a CPU run of megatron needs besides is `engine_on`'s (models/megatron_on_cpu.py). The
step reads the host once (the agreement: `train_step`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ... import collectives
from ...runtime import batch_to_device, bf16_on
from .. import progress
from ..build import build_model
from ..metrics import PairSum
from ..signals import StopRequest, agree
from . import Built, EngineStep, run_layout


@dataclass
class MegatronEngine:
    """What the loop steps: this stage's DDP-wrapped model chunks (virtual stages in order),
    megatron's optimizer and the chunks' TransformerConfig with the loop's hooks set."""

    chunks: list[Any]
    optimizer: Any
    config: Any

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The model chunks themselves (NumericLossGPTModel), without DDP."""
        return [chunk.module for chunk in self.chunks]

    def train(self) -> None:
        for chunk in self.chunks:
            chunk.train()

    def eval(self) -> None:
        for chunk in self.chunks:
            chunk.eval()


@contextlib.contextmanager
def synced_weights(engine: MegatronEngine):
    """The chunks' weights as the last step left them, for a forward or a read outside the
    training step. With the overlapped parameter all-gather (the distributed optimizer on
    GPU) the step's gather is issued by the next training forward's pre-hook: Megatron-LM's
    evaluation and save bracket themselves with `disable_forward_pre_hook(param_sync=True)`,
    which gathers now, and `enable_forward_pre_hook`; so does this."""
    overlapped = any(chunk.ddp_config.overlap_param_gather for chunk in engine.chunks)
    if overlapped:
        for chunk in engine.chunks:
            chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        if overlapped:
            for chunk in engine.chunks:
                chunk.enable_forward_pre_hook()


def stage_flags(vp: int | None) -> list[tuple[bool, bool, int | None]]:
    """(pre_process, post_process, vp_stage) of each model chunk of this rank: the
    embedding on the first chunk of the first stage, the output layer and the loss head on
    the last chunk of the last stage."""
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    chunks = vp or 1
    return [
        (
            pp_rank == 0 and v == 0,
            pp_rank == pp - 1 and v == chunks - 1,
            v if vp else None,
        )
        for v in range(chunks)
    ]


def stage_overrides(cfg) -> dict[str, Any]:
    """TransformerConfig fields of the engine: megatron's per-token loss (what makes the sum
    over micro-batches the global batch's loss), the uneven first and last stages, and, as
    Megatron-LM sets it, a stage's sent activations freed once sent
    (`deallocate_pipeline_outputs`: only their autograd node stays for backward; megatron's
    schedules read it at PP > 1)."""
    fields: dict[str, Any] = {"calculate_per_token_loss": True, "deallocate_pipeline_outputs": True}
    if cfg.parallel.first_stage_layers is not None:
        fields["num_layers_in_first_pipeline_stage"] = cfg.parallel.first_stage_layers
    if cfg.parallel.last_stage_layers is not None:
        fields["num_layers_in_last_pipeline_stage"] = cfg.parallel.last_stage_layers
    return fields


def wrap(cfg, device: torch.device, chunks: list[torch.nn.Module], schedule) -> tuple:
    """(MegatronEngine, its learning-rate scheduler) around this rank's built chunks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    choices = engine_choices(cfg, device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=choices.overlap_grad_reduce,
        use_distributed_optimizer=choices.distributed_optimizer,
        overlap_param_gather=choices.overlap_param_gather,
        bucket_size=cfg.parallel.ddp_bucket_size,
        # Megatron-LM's --align-param-gather default with virtual stages: every chunk's
        # gather started at the first chunk's forward (param_sync_func below)
        align_param_gather=choices.overlap_param_gather and len(chunks) > 1,
    )
    optim = cfg.optim
    if choices.bf16:
        for chunk in chunks:
            float16_parameters(chunk)
    with engine_on(device):
        # bucketing on the first chunk only, as Megatron-LM's get_model does
        wrapped = [
            DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                min_lr=optim.min_lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.beta1,
                adam_beta2=optim.beta2,
                adam_eps=optim.eps,
                clip_grad=optim.clip_grad,
                bf16=choices.bf16,
                params_dtype=chunks[0].config.params_dtype,
                use_distributed_optimizer=choices.distributed_optimizer,
            ),
            wrapped,
            use_gloo_process_groups=False,  # none exist (parallel.init_model_parallel)
        )
    apply_group_multipliers(optimizer, optim.weight_decay)
    config = chunks[0].config
    # what Megatron-LM's train() sets before its loop
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    if choices.overlap_grad_reduce:
        sync = [c.start_grad_sync for c in wrapped]
        config.grad_sync_func = sync if len(wrapped) > 1 else sync[0]
    if choices.overlap_param_gather and ddp_config.align_param_gather:
        # the interleaved schedule starts each chunk's gather itself (its first forward)
        gather = [c.start_param_sync for c in wrapped]
        config.param_sync_func = gather if len(wrapped) > 1 else gather[0]
    config.finalize_model_grads_func = finalize_per_token
    return MegatronEngine(wrapped, optimizer, config), LambdaSchedules(optimizer, schedule.factor)


def finalize_per_token(model: list, num_tokens=None, pg_collection=None, **options) -> None:
    """megatron's `finalize_model_grads` (the schedules call it after the last backward: the
    data-parallel reduction, the tied embedding's sum across stages), then its division of
    every gradient by the global batch's token count, on the device: megatron's own reads the
    count on the host (`if num_tokens > 0`, once per model chunk). The count is the last
    stage's (the other stages' schedules hold 0): summed over the pipeline, then over the
    data-parallel ranks, as megatron's broadcast and all-reduce do."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, **options)
    if num_tokens is None:
        return
    if pg_collection is not None:
        pp_group, dp_group = pg_collection.pp, pg_collection.dp_cp
    else:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    collectives.all_reduce(num_tokens, group=pp_group)
    collectives.all_reduce(num_tokens, group=dp_group)
    scaling = 1.0 / num_tokens.clamp(min=1)  # no tokens: megatron leaves the gradients
    for chunk in model:
        chunk.scale_gradients(scaling)


def float16_parameters(chunk: torch.nn.Module) -> None:
    """Every trained parameter of `chunk` in its config's params_dtype, as Megatron-LM's
    Float16Module casts a bf16 model before its DistributedDataParallel (`module.bfloat16()`):
    megatron's local norms (no Transformer Engine) build their weights in float32, which would
    otherwise train as float32 parameters in a buffer of their own beside the bf16 ones. EMO's
    cost embedding (a buffer, frozen) keeps its dtype."""
    dtype = chunk.config.params_dtype
    for param in chunk.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)


def torch_optimizers(optimizer) -> list:
    """The torch optimizers megatron's optimizer holds (one, or one per chained group)."""
    return [o.optimizer for o in megatron_optimizers(optimizer)]


def apply_group_multipliers(optimizer, weight_decay: float) -> None:
    """Each parameter group's weight decay as megatron's OptimizerParamScheduler sets it,
    weight_decay x the group's wd_mult: megatron marks norm weights and biases wd_mult=0 (its
    default groups), but only its own scheduler applies it, and this engine steps a LambdaLR
    (`LambdaSchedules`, which applies lr_mult) instead. The same groups as the deepspeed
    engine's (training/build.decays)."""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


class LambdaSchedules:
    """torch's LambdaLR on each torch optimizer megatron's optimizer holds (one, or one per
    chained group), stepped together: the deepspeed engine's schedule, times each group's
    lr_mult (megatron's OptimizerParamScheduler's rule)."""

    def __init__(self, optimizer, factor) -> None:
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(inner, _multiplied(factor, inner.param_groups))
            for inner in torch_optimizers(optimizer)
        ]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    @property
    def last_epoch(self) -> int:
        """The schedule's position (steps taken), as LambdaLR's."""
        return self.schedulers[0].last_epoch

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state)


def _multiplied(factor, groups: list[dict]) -> list:
    """LambdaLR's per-group functions: the schedule's factor times the group's lr_mult."""
    return [partial(_times, factor, group.get("lr_mult", 1.0)) for group in groups]


def _times(factor, multiplier: float, step: int) -> float:
    return factor(step) * multiplier


def _forward_step_func(device: torch.device, seq_len: int, probe: bool):
    """The forward step megatron's schedules call per micro-batch and model chunk: what the
    chunk needs of the host batch moved to the device (tokens and positions on the first
    stage, labels and loss mask on the last, nothing between), the model, and the loss
    function bound to the micro-batch's mask. probe: the gradient probe on the last stage's
    first micro-batch."""
    from ...models import loss_func

    probes_left = [probe]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)  # None on a stage between the first and the last
        chunk = model.module
        tokens = positions = labels = loss_mask = None
        extra = {}
        if chunk.pre_process:
            tokens = _on(device, batch, "tokens")["tokens"]
            positions = torch.arange(seq_len, device=device).expand_as(tokens)
        if chunk.post_process:
            on_device = _on(device, batch, "labels", "loss_mask")
            labels, loss_mask = on_device["labels"], on_device["loss_mask"]
            if probes_left.pop() if probes_left else False:
                extra["numeric_grad_probe"] = True
        output = model(tokens, positions, None, labels=labels, loss_mask=loss_mask, **extra)
        return output, partial(loss_func, loss_mask)

    return forward_step


def _on(device: torch.device, batch: dict, *names: str) -> dict[str, torch.Tensor]:
    """`names` of `batch` on the compute device (a held-out batch is there already)."""
    host = {n: batch[n] for n in names if batch[n].device != device}
    return {n: batch[n] for n in names} | batch_to_device(host, device)


def _schedule(run, micro_batches: list[dict | None], *, forward_only: bool, probe: bool) -> list:
    """The micro-batches through megatron's schedule: the report of each on the last stage,
    nothing elsewhere. A stage between the first and the last gets None for each (it reads
    no data): the shapes of the activations it receives and sends are then the run's
    micro-batch size and sequence length, which every training batch has."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = run.engine.chunks
    iterators = [iter(micro_batches) for _ in chunks]
    real = next((b for b in micro_batches if b is not None), None)
    if real is not None:
        micro, seq = real["tokens"].shape
    else:
        micro, seq = run.cfg.train.micro_batch_size, run.cfg.train.seq_len
    return get_forward_backward_func()(
        forward_step_func=_forward_step_func(run.device, seq, probe),
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=micro,
        forward_only=forward_only,
    )


def stage_reports(
    reports: list[dict], probe: bool, device: torch.device
) -> tuple[list[str], torch.Tensor]:
    """(names, [metrics, 2] float64) of the last stage's reports summed over micro-batches,
    on every stage of the pipeline (the console, the metrics and the stop agreement read them
    on any rank); not yet reduced over data-parallel ranks. The names are the loss function's
    (models/gpt.report_names: every stage knows them, so only the values travel, on the
    device)."""
    from megatron.core import parallel_state

    from ...models.gpt import report_names

    totals = PairSum()
    for report in reports:
        totals.add(report)
    names = report_names(probe)
    if totals.totals and sorted(totals.totals) != names:  # the last stage's own
        raise AssertionError(f"loss_func reported {sorted(totals.totals)}, not {names}")
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return names, torch.stack([totals.totals[n] for n in names])
    if totals.totals:
        pairs = torch.stack([totals.totals[n] for n in names])
    else:
        pairs = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    group = parallel_state.get_pipeline_model_parallel_group()
    return names, collectives.all_reduce(pairs, group=group)  # one stage holds them


def train_step(
    run,
    micro_batches: list[dict],
    probe: bool,
    stop: StopRequest | None,
    writing: bool,
    lost: bool = False,
) -> EngineStep:
    """One optimizer step over this rank's micro-batches (host tensors)."""
    from megatron.core import parallel_state

    engine = run.engine
    for chunk in engine.chunks:
        chunk.zero_grad_buffer()
    engine.optimizer.zero_grad()
    reports = _schedule(run, micro_batches, forward_only=False, probe=probe)
    names, pairs = stage_reports(reports, probe, run.device)
    local_loss = pairs[names.index("lm loss"), 0]  # this data-parallel rank's loss sum
    dp_pairs = collectives.all_reduce(pairs, group=parallel_state.get_data_parallel_group())
    # the norm before the update, on the device (`gradient_norm`), so a non-finite one skips
    # the step in the same agreement as a non-finite loss: the step's one host read.
    # megatron's own step would take it twice (prepare_grads + get_grad_norm, then clip_grad_norm,
    # each a read) and apply a non-finite one under bf16, having no loss scaler to find it
    found_inf = engine.optimizer.prepare_grads()  # a host flag only with a loss scaler
    norm = gradient_norm(engine.optimizer, run.device)
    nonfinite = ~torch.isfinite(local_loss) | ~torch.isfinite(norm)
    agreed = agree(stop, nonfinite, writing, lost)
    if agreed.nonfinite or found_inf:
        return EngineStep(names, dp_pairs, norm, agreed, skipped=True)
    if run.cfg.optim.clip_grad > 0:
        clip_gradients(engine.optimizer, run.cfg.optim.clip_grad, norm)
    engine.optimizer.step_with_ready_grads()
    run.scheduler.step()
    return EngineStep(names, dp_pairs, norm, agreed, skipped=False)


def gradient_norm(optimizer, device: torch.device) -> torch.Tensor:
    """The L2 norm of the step's gradients before clipping, a 0-dim float32 tensor on the
    device: megatron's get_grad_norm_fp32 (each optimizer's main gradients for the norm, shared
    and tensor-parallel duplicates left out, their squares summed over its grad-stats group:
    the model-parallel ranks, and the data-parallel ones with the distributed optimizer),
    without its host read (`.item()`)."""
    total = None
    for inner in megatron_optimizers(optimizer):
        grads = inner.get_main_grads_for_grad_norm()
        if grads:
            squares = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
        else:
            squares = torch.zeros((), dtype=torch.float32, device=device)  # nothing held
        collectives.all_reduce(squares, group=inner.get_grad_stats_parallel_group())
        total = squares if total is None else total + squares
    return total.sqrt()


def clip_gradients(optimizer, max_norm: float, norm: torch.Tensor) -> None:
    """megatron's clip_grad_by_total_norm_fp32 with the norm already taken: every main
    gradient times max_norm / (norm + 1e-6) where that is below 1, on the device (x 1.0
    elsewhere, which leaves a gradient as it is)."""
    coefficient = (max_norm / (norm + 1.0e-6)).clamp(max=1.0)
    for inner in megatron_optimizers(optimizer):
        grads = [p.grad for p in inner.get_parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coefficient)


def megatron_optimizers(optimizer) -> list:
    """megatron's optimizers inside `optimizer` (one, or each of a chained optimizer's)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def score(run, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Held-out micro-batches' report {name: [sum, count]} on every stage (forward only), in
    one schedule call, so the stages work on them side by side as in training. The
    interleaved schedule takes a multiple of the pipeline's size: a shorter last group is
    filled with copies of its last micro-batch, whose reports are dropped (megatron's
    schedules return the last stage's reports in micro-batch order)."""
    from megatron.core import parallel_state

    filled = list(batches)
    if len(run.engine.chunks) > 1:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        filled += [batches[-1]] * (-len(batches) % pp)
    reports = _schedule(run, filled, forward_only=True, probe=False)[: len(batches)]
    names, pairs = stage_reports(reports, False, run.device)
    return {name: pairs[i] for i, name in enumerate(names)}


def parameter_count(engine: MegatronEngine, device: torch.device) -> int:
    """The parameters every stage holds, summed over the pipeline (a tied embedding counts
    on the first and the last stage, as each holds a copy), times tensor parallel's shards
    as the caller counts them."""
    from megatron.core import parallel_state

    local = sum(p.numel() for m in engine.modules for p in m.parameters())
    count = torch.tensor([float(local)], dtype=torch.float64, device=device)
    collectives.all_reduce(count, group=parallel_state.get_pipeline_model_parallel_group())
    return int(count.item())  # once, at start


def build_stages(cfg, device: torch.device, tokenizer) -> list[torch.nn.Module]:
    """This rank's model chunks for megatron's engine: one per virtual stage of its pipeline
    stage, each with its layers (megatron numbers them from the stage's offset) and the
    initial weights of those layers. A random start draws each of its tensors from
    train.seed and the tensor's global name (training/initial_weights.initialize_weights),
    so the chunks together are the model the deepspeed engine's build draws, at any layout.
    Every chunk seeds its generators with train.seed itself, not Megatron-LM's
    train.seed + 100 x pipeline rank: that offset gives each stage its own dropout masks,
    and our models have no dropout (models/llama.transformer_config)."""
    overrides = {
        **stage_overrides(cfg),
        **pipeline_overrides(device, cfg.parallel.pipeline_parallel),
        **fusion_overrides(device),
    }
    chunks = []
    for flags in stage_flags(cfg.parallel.virtual_pipeline_parallel):
        with building_stages(device):  # tied embeddings: the last stage's copy
            chunks.append(build_model(cfg, device, tokenizer, stage=flags, **overrides))
    return chunks


# ---- device choices ---------------------------------------------------------------------


@dataclass(frozen=True)
class EngineChoices:
    """What megatron-core's engine runs: the config's parallel.distributed_optimizer,
    overlap_grad_reduce, overlap_param_gather and train.bf16, each on with CUDA where unset.
    The same choices run on CPU when the config sets them (the suite runs the GPU
    configuration so: models/megatron_on_cpu.py replaces only the calls that need CUDA)."""

    distributed_optimizer: bool  # sharded fp32 masters and moments, reduce-scatter + gather
    overlap_grad_reduce: bool  # each bucket's gradient reduction behind backward
    overlap_param_gather: bool  # each bucket's weight gather behind the next forward
    bf16: bool  # bf16 parameters with fp32 masters


def engine_choices(cfg, device: torch.device) -> EngineChoices:
    """The run's choices (`EngineChoices`) on `device`: what the config sets, else what
    Megatron-LM runs on a GPU (all on) and what megatron's float32 path runs elsewhere."""
    cuda = device.type == "cuda"
    parallel = cfg.parallel

    def chosen(setting: bool | None) -> bool:
        return cuda if setting is None else setting

    distributed = chosen(parallel.distributed_optimizer)
    return EngineChoices(
        distributed_optimizer=distributed,
        overlap_grad_reduce=chosen(parallel.overlap_grad_reduce),
        overlap_param_gather=distributed and chosen(parallel.overlap_param_gather),
        bf16=bf16_on(cfg.train.bf16, device),
    )


def engine_on(device: torch.device):
    """Around building megatron-core's DDP and optimizer for a run on `device` (a context):
    on CPU their hard-coded CUDA allocations are moved to the CPU and their CUDA type checks
    read a CPU tensor as its CUDA twin (models/megatron_on_cpu.py); nothing on GPU."""
    if device.type == "cpu":
        from ...models import megatron_on_cpu

        megatron_on_cpu.rebind()
        return megatron_on_cpu.cuda_type_names()
    return contextlib.nullcontext()


def building_stages(device: torch.device):
    """Around building pipeline stages on `device`: on CPU, megatron's `tensor.cuda()` of a
    tied embedding's copy on the last stage keeps the tensor where it is; nothing on GPU."""
    if device.type == "cpu":
        from ...models import megatron_on_cpu

        return megatron_on_cpu.tensor_cuda_stays()
    return contextlib.nullcontext()


def fusion_overrides(device: torch.device) -> dict[str, Any]:
    """megatron's gradient-accumulation fusion on GPU where megatron found its kernel (Apex's
    fused_weight_gradient_mlp_cuda, read from megatron's own import-time answer): each
    linear layer's weight gradient summed inside its GEMM into the float32 `main_grad` this
    engine's DistributedDataParallel holds, as Megatron-LM runs it. The deepspeed engine has
    no main_grad (models/spec.choose_fusions keeps it off there)."""
    if device.type != "cuda":
        return {}
    from megatron.core.tensor_parallel import layers

    return {"gradient_accumulation_fusion": True} if layers._grad_accum_fusion_available else {}


def pipeline_overrides(device: torch.device, pipeline_parallel: int) -> dict[str, Any]:
    """TransformerConfig fields of the pipeline's point-to-point traffic: gloo (CPU)
    reorders batched sends and receives, so they go one by one there."""
    if pipeline_parallel > 1 and device.type == "cpu":
        return {"batch_p2p_comm": False}
    return {}


# ---- the config and the plan ------------------------------------------------------------


def config_problem(cfg) -> str | None:
    """What megatron's engine cannot do with the rest of the config, in one line (None:
    nothing)."""
    parallel = cfg.parallel
    if parallel.overlap_param_gather and parallel.distributed_optimizer is False:
        return (
            "parallel.overlap_param_gather=true needs parallel.distributed_optimizer (only its "
            "weights are gathered): set it true or leave it unset"
        )
    if cfg.train.checkpoints and not cfg.train.layout_free_checkpoints:
        return (
            "train.layout_free_checkpoints=false keeps DeepSpeed's own optimizer state, which "
            "train.engine=megatron has not: its checkpoints are layout-free (drop the override)"
        )
    if parallel.virtual_pipeline_parallel is not None:
        if parallel.pipeline_parallel == 1:
            return "parallel.virtual_pipeline_parallel needs parallel.pipeline_parallel > 1"
        uneven = parallel.first_stage_layers is not None or parallel.last_stage_layers is not None
        if uneven:
            return (
                "parallel.first_stage_layers / last_stage_layers with "
                "parallel.virtual_pipeline_parallel: not supported here (every model chunk "
                "gets the same number of layers)"
            )
        return _stage_split_problem(cfg)
    elif parallel.pipeline_parallel > 1:
        return _stage_split_problem(cfg)
    elif parallel.first_stage_layers is not None or parallel.last_stage_layers is not None:
        return "parallel.first_stage_layers / last_stage_layers need parallel.pipeline_parallel > 1"
    return None


def _stage_split_problem(cfg) -> str | None:
    """Whether megatron-core splits model.num_layers over the pipeline's stages (and their
    virtual stages) as the config asks, every model chunk at least one layer: its own check
    and arithmetic (`chunk_layers`), in one line naming our fields (None: it does)."""
    parallel, layers = cfg.parallel, cfg.model.num_layers
    try:
        split = chunk_layers(cfg)
    except ValueError as err:
        reason = " ".join(str(err).split())  # megatron's messages carry runs of spaces
    else:
        if min(min(stage) for stage in split) >= 1:
            return None
        reason = f"a model chunk would get no layers: {split}"
    pp, vp = parallel.pipeline_parallel, parallel.virtual_pipeline_parallel
    if vp is not None:
        return (
            f"model.num_layers={layers} does not split into parallel.pipeline_parallel x "
            f"virtual_pipeline_parallel = {pp * vp} equal chunks of at least one layer "
            f"(megatron-core: {reason})"
        )
    given = ", ".join(
        f"parallel.{n}={v}"
        for n, v in (
            ("first_stage_layers", parallel.first_stage_layers),
            ("last_stage_layers", parallel.last_stage_layers),
        )
        if v is not None
    )
    return (
        f"model.num_layers={layers} does not split over parallel.pipeline_parallel={pp} "
        f"stages{' with ' + given if given else ''}: the stages "
        f"{'between ' if given else ''}take equal shares, every stage at least one layer "
        f"(megatron-core: {reason})"
    )


def chunk_layers(cfg) -> list[list[int]]:
    """The decoder layers of each model chunk, [pipeline stage][virtual stage], computed by
    megatron-core itself: the split fields of the run's TransformerConfig (`stage_overrides`:
    num_layers_in_first / last_pipeline_stage) checked by its own __post_init__, then
    `get_num_layers_to_build` for every stage and chunk, as the build calls it. So --check
    and --dry-run refuse what the build would (a stage of 0 layers, a first stage of 0),
    on the installed megatron-core's rules. ValueError with megatron's reason otherwise."""
    import warnings

    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel = cfg.parallel
    pp, vp = parallel.pipeline_parallel, parallel.virtual_pipeline_parallel
    with warnings.catch_warnings():  # its notices about fields the split does not read
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=cfg.model.num_layers,
            hidden_size=cfg.model.hidden_size,
            num_attention_heads=cfg.model.num_attention_heads,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            pipeline_dtype=torch.float32,  # required at PP > 1; the split does not read it
            **stage_overrides(cfg),
        )
    try:
        return [
            [
                get_num_layers_to_build(config, vp_stage=v if vp else None, pp_rank=stage)
                for v in range(vp or 1)
            ]
            for stage in range(pp)
        ]
    except AssertionError as err:  # its even split is asserted, not raised
        raise ValueError(str(err)) from None


def stage_layers(cfg) -> list[int]:
    """The decoder layers of each pipeline stage (all its virtual stages together), as
    megatron splits them (`chunk_layers`; config.py refuses a split megatron refuses)."""
    if cfg.parallel.pipeline_parallel == 1:
        return [cfg.model.num_layers]
    return [sum(stage) for stage in chunk_layers(cfg)]


def in_flight(pp: int, stage: int, micro_batches: int, virtual: int | None) -> int:
    """Micro-batches whose activations one stage holds at once under megatron's schedules
    (per model chunk with virtual stages): 1F1B's warm-up, pp - stage (at most the step's
    micro-batches); interleaved, its warm-up of (pp - stage - 1) x 2 + (v - 1) x pp chunks,
    plus the one in steady state, in chunk-micro-batches."""
    if virtual is None:
        return min(micro_batches, pp - stage)
    return min(micro_batches * virtual, (pp - stage - 1) * 2 + (virtual - 1) * pp + 1)


def megatron_state_bytes(tensors: list[int], data_parallel: int, distributed: bool) -> dict:
    """What megatron-core's engine allocates for the parameters `tensors` of one rank, with
    bf16 weights, its float32 gradient buffer (grad_reduce_in_fp32, whole on every rank)
    and Adam's float32 master weights and two moments, 12 bytes a parameter, sharded over
    the data-parallel ranks by the distributed optimizer (whole without it)."""
    params = sum(tensors)
    optimizer = 12 * params // (data_parallel if distributed else 1)
    return {"weights": 2 * params, "gradients": 4 * params, "optimizer": optimizer, "buffers": 0}


def memory_plan(cfg, world_size: int, gpu_memory_gib: float | None):
    """Each pipeline stage's GPU (its layers, the embedding on the first, output layer and
    logits on the last, the activations of the micro-batches it holds at once: `in_flight`),
    on megatron's distributed optimizer; the plan of the stage that needs the most."""
    from .. import plan

    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    virtual = cfg.parallel.virtual_pipeline_parallel
    dp = cfg.data_parallel_size(world_size)
    micro_batches = cfg.accumulation_steps(world_size)
    distributed = engine_choices(cfg, torch.device("cuda")).distributed_optimizer
    b, s = cfg.train.micro_batch_size, cfg.train.seq_len
    recompute = cfg.train.activation_checkpointing
    plans = []
    for stage, layers in enumerate(stage_layers(cfg)):
        first, last = stage == 0, stage == pp - 1
        per_gpu = megatron_state_bytes(
            plan.rank_tensors(cfg.model, tp, (layers, first, last)), dp, distributed
        )
        chunk_layers = layers // (virtual or 1)
        held = in_flight(pp, stage, micro_batches, virtual)
        one = plan.activation_bytes(cfg.model, tp, b, s, recompute, 2, layers=chunk_layers)
        per_gpu["activations"] = held * one
        per_gpu["logits"] = plan.logits_bytes(cfg.model, tp, b, s, 2) if last else 0
        per_gpu["reserve"] = plan.RESERVE
        per_gpu["total"] = sum(per_gpu.values())
        plans.append((per_gpu["total"], stage, per_gpu))
    _, stage, per_gpu = max(plans, key=lambda found: found[0])
    memory, label = plan.device_memory(gpu_memory_gib)
    return plan.Plan(plan.count_parameters(cfg.model, tp), per_gpu, memory, label, stage=stage)


# ---- the engine -------------------------------------------------------------------------


class _Megatron:
    """megatron-core's engine behind the loop's protocol (training/engines.EngineKind)."""

    name = "megatron"
    owner = "megatron-core's"

    def describe(self, cfg) -> str:
        return "megatron-core's engine"

    def config_problem(self, cfg) -> str | None:
        return config_problem(cfg)

    def layout(self, cfg, world: int):
        # no ZeRO stage: megatron's engine shards with its distributed optimizer
        return run_layout(cfg, world, self.name, zero_stage=None)

    def memory_plan(self, cfg, world: int, gpu_memory_gib: float | None):
        return memory_plan(cfg, world, gpu_memory_gib)

    def reads_data(self, cfg) -> bool:
        """All ranks but the pipeline stages between the first (tokens) and the last
        (labels, loss mask), which take activations only, as in Megatron-LM's get_batch."""
        if cfg.parallel.pipeline_parallel == 1:
            return True
        flags = stage_flags(cfg.parallel.virtual_pipeline_parallel)
        return any(pre or post for pre, post, _ in flags)

    def build(self, cfg, device: torch.device, tokenizer, schedule, world: int) -> Built:
        chunks = build_stages(cfg, device, tokenizer)
        engine, scheduler = wrap(cfg, device, chunks, schedule)
        count = parameter_count(engine, device) * cfg.parallel.tensor_parallel
        progress.model_built(count, self.owner)
        return Built(engine, scheduler, count)

    def step(self, run, micro_batches, probe, stop, writing, lost=False) -> EngineStep:
        return train_step(run, micro_batches, probe, stop, writing, lost)

    def score(self, run, batch):
        return score(run, batch)

    def evaluation_weights(self, engine):
        return synced_weights(engine)

    def checkpoint_adapter(self, run):
        from .megatron_checkpoint import MegatronAdapter

        return MegatronAdapter(run.engine, dp_rank=run.dp_rank)

    def native_state(self, engine) -> None:
        return None  # its checkpoints are layout-free only


KIND = _Megatron()
