"""DeepSpeed's ZeRO engine (train.engine=deepspeed, the default): the model built whole on
each rank, DeepSpeed's engine around it (ZeRO 1-3 over data-parallel ranks, its JSON
generated from the run config), and one step as a plain loop takes it: each micro-batch's
forward (which ends in the loss head), `engine.backward`, `engine.step`. One pipeline stage:
megatron's schedules run their own backward, which would bypass DeepSpeed's. Everything of
this engine is here (`KIND`, training/engines/__init__.EngineKind): its config rules, its
set-up, step, JSON, ZeRO memory plan and own checkpoint state; its checkpoint adapter
beside it (deepspeed_checkpoint.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ... import collectives
from ...runtime import batch_to_device, bf16_on
from .. import progress
from ..build import build_model, parameter_groups
from ..metrics import PairSum
from ..signals import StopRequest, agree
from . import Built, EngineStep, run_layout


def deepspeed_config(cfg, world_size: int, *, gpu: bool) -> dict[str, Any]:
    """The DeepSpeed JSON of a run (generated, so it cannot disagree with the run config):
    bf16 as train.bf16 says (unset: on GPU), float32 otherwise; torch's AdamW (multi-tensor
    on GPU) under ZeRO on both.

    Not DeepSpeed's FusedAdam: it is compiled at the first step (nvcc, ninja and the Python
    headers matching torch's CUDA on every node), a start-up failure on images without a
    compiler that torch's own kernels do not have; its speed-up is in the optimizer step
    alone, unmeasured here.

    With bf16, micro-batch gradients are summed and reduced across data-parallel ranks in
    float32 (`data_types.grad_accum_dtype`, `communication_data_type`), as megatron does:
    DeepSpeed's default sums and reduces them in bf16, which rounds the running sum at every
    micro-batch (0.85% of the gradient over 64 micro-batches against 0.21% for float32 sums,
    tests/training/test_bf16_accumulation.py). At ZeRO 1 this selects DeepSpeed's
    BF16_Optimizer."""
    bf16 = bf16_on(cfg.train.bf16, torch.device("cuda" if gpu else "cpu"))
    precision: dict[str, Any] = {"bf16": {"enabled": bf16}}
    if bf16:
        precision.update(data_types={"grad_accum_dtype": "fp32"}, communication_data_type="fp32")
    return {
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.accumulation_steps(world_size),
        "gradient_clipping": cfg.optim.clip_grad,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.optim.lr,
                "betas": [cfg.optim.beta1, cfg.optim.beta2],
                "eps": cfg.optim.eps,
                "weight_decay": cfg.optim.weight_decay,
                "torch_adam": True,
            },
        },
        **precision,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def config_problem(cfg) -> str | None:
    """What DeepSpeed's engine cannot do with the rest of the config, in one line (None:
    nothing): pipeline stages, megatron's DDP settings."""
    parallel = cfg.parallel
    staged = {
        "pipeline_parallel": parallel.pipeline_parallel > 1,
        "virtual_pipeline_parallel": parallel.virtual_pipeline_parallel is not None,
        "first_stage_layers": parallel.first_stage_layers is not None,
        "last_stage_layers": parallel.last_stage_layers is not None,
    }
    for name, given in staged.items():
        if given:
            return (
                f"parallel.{name} needs train.engine=megatron: megatron-core's pipeline "
                "schedules run their own backward, which would bypass the DeepSpeed engine"
            )
    megatrons = (
        "distributed_optimizer",
        "overlap_grad_reduce",
        "overlap_param_gather",
        "ddp_bucket_size",
    )
    for name in megatrons:
        if getattr(parallel, name) is not None:
            return (
                f"parallel.{name} is megatron-core's engine's (train.engine=megatron); "
                "DeepSpeed's is parallel.zero_stage: drop it"
            )
    return None


# ---- the ZeRO memory model ----------------------------------------------------------------


@dataclass(frozen=True)
class ZeroSizes:
    """The sizes (in elements) of DeepSpeed's zero_optimization section that allocate memory:
    DeepSpeed's defaults (deepspeed/runtime/zero/config.py, checked against it by a test)
    unless the run's DeepSpeed config sets them."""

    reduce_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000

    @classmethod
    def of(cls, zero_optimization: dict) -> ZeroSizes:
        names = cls.__dataclass_fields__
        return cls(**{k: int(v) for k, v in zero_optimization.items() if k in names})


def model_state_bytes(
    tensors: list[int], largest_layer: int, data_parallel: int, zero_stage: int, sizes: ZeroSizes
) -> dict[str, int]:
    """What DeepSpeed allocates on one GPU for the parameters `tensors` of one tensor-parallel
    rank (element counts) with bf16 weights and gradients summed and reduced in float32, the
    run's DeepSpeed config (deepspeed 0.19.8; torch's AdamW: float32 master weights and two
    moments, 12 bytes a parameter, partitioned at every stage). By part:

    * stage 1: DeepSpeed's BF16_Optimizer (its choice for bf16 with float32 accumulation at
      stage 1): whole bf16 weights, a float32 gradient buffer of every parameter and the
      bf16 `.grad` beside it on every rank (runtime/bf16_optimizer.py), 8 bytes a parameter
      whatever the data-parallel size, and its reduction all-reduces that whole buffer;
    * stage 2: whole bf16 weights, the float32 gradients of this rank's partition only
      (stage_1_and_2.py's compact partition buffer); buffers: the bf16 reduce bucket
      (`reduce_bucket_size`), its float32 copy for the reduce-scatter and the bf16 gradient
      of the largest layer before it is copied into the bucket, during backward;
    * stage 3: this rank's partition of the bf16 weights and of the float32 gradients, the
      persistent parameters (at most `stage3_param_persistence_threshold` elements each)
      whole; buffers: the float32 reduce bucket, held for the whole run (stage3.py), and the
      parameters gathered in forward and backward: every one reused within
      `stage3_max_reuse_distance` stays gathered between its forward and its backward (the
      whole model when it is smaller), plus the prefetch bucket and the layer at work.
    """
    n, params = data_parallel, sum(tensors)
    optimizer = 12 * params // n
    if zero_stage == 1:
        gradients = 4 * params + 2 * params  # float32 and bf16, of every parameter
        return {"weights": 2 * params, "gradients": gradients, "optimizer": optimizer, "buffers": 0}
    if zero_stage == 2:
        bucket = sizes.reduce_bucket_size
        return {
            "weights": 2 * params,
            "gradients": 4 * params // n,
            "optimizer": optimizer,
            "buffers": 2 * bucket + 4 * min(bucket, params) + 2 * largest_layer,
        }
    threshold = sizes.stage3_param_persistence_threshold
    persistent = sum(t for t in tensors if t <= threshold)
    gathered = min(
        params - persistent,
        sizes.stage3_max_reuse_distance + sizes.stage3_prefetch_bucket_size + largest_layer,
    )
    return {
        "weights": 2 * params // n + 2 * persistent,
        "gradients": 4 * params // n,
        "optimizer": optimizer,
        "buffers": 4 * sizes.reduce_bucket_size + 2 * gathered + 2 * largest_layer,
    }


def memory_plan(cfg, world_size: int, gpu_memory_gib: float | None):
    """Bytes per GPU under DeepSpeed's ZeRO stage (`model_state_bytes`: counted from
    DeepSpeed's engine), activations, logits and a reserve (training/plan.py's terms)."""
    from .. import plan

    tp = cfg.parallel.tensor_parallel
    dp = cfg.data_parallel_size(world_size)
    params = plan.count_parameters(cfg.model, tp)
    recompute = cfg.train.activation_checkpointing
    b, s = cfg.train.micro_batch_size, cfg.train.seq_len
    zero = deepspeed_config(cfg, world_size, gpu=True)["zero_optimization"]
    per_gpu = model_state_bytes(
        plan.rank_tensors(cfg.model, tp),
        params.largest_layer,
        dp,
        zero["stage"],
        ZeroSizes.of(zero),
    )
    per_gpu["activations"] = plan.activation_bytes(cfg.model, tp, b, s, recompute, 2)
    per_gpu["logits"] = plan.logits_bytes(cfg.model, tp, b, s, 2)
    per_gpu["reserve"] = plan.RESERVE
    per_gpu["total"] = sum(per_gpu.values())
    memory, label = plan.device_memory(gpu_memory_gib)
    return plan.Plan(params, per_gpu, memory, label)


def build(cfg, device: torch.device, tokenizer, schedule, world: int) -> Built:
    """The whole model on this rank, then DeepSpeed's engine around it with the run's
    schedule as a LambdaLR."""
    from ...parallel import MegatronMPU

    model = build_model(cfg, device, tokenizer)
    params = sum(p.numel() for p in model.parameters()) * cfg.parallel.tensor_parallel
    progress.model_built(params, KIND.owner)

    import deepspeed

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)

    engine, _, _, lr_scheduler = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(model),  # no decay on norms and biases
        config=deepspeed_config(cfg, world, gpu=device.type == "cuda"),
        mpu=MegatronMPU(),
        lr_scheduler=scheduler,
    )
    return Built(engine, lr_scheduler, params)


def forward(run, batch: dict[str, torch.Tensor], probe: bool = False):
    """A micro-batch already on the compute device -> (loss sum, tokens, report pairs).
    probe: also measure the numeric term's share of the gradient at the output layer's
    logits (`NumericLossGPTModel.forward`'s `numeric_grad_probe`: the report then holds
    'numeric_grad_share' and 'numeric_grad_cos').

    The model's forward ends in its loss head (`NumericLossGPTModel._postprocess`) and
    returns the head's `NumericLossOutput`, read here from that return value. The head runs
    inside the engine's forward so that ZeRO 3 gathers the output weight for it (and again
    for its backward) as for any layer (docs/architecture.md, "Megatron adapter")."""
    from ...models import loss_func

    tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    positions = torch.arange(tokens.shape[1], device=run.device).expand_as(tokens)
    probed = {"numeric_grad_probe": True} if probe else {}
    output = run.engine(tokens, positions, None, labels=labels, loss_mask=loss_mask, **probed)
    return loss_func(loss_mask, output)


def step(
    run,
    micro_batches: list[dict[str, torch.Tensor]],
    probe: bool,
    stop: StopRequest | None,
    writing: bool,
    lost: bool = False,
) -> EngineStep:
    """The step on the DeepSpeed engine: each micro-batch's forward, backward and step.

    Each micro-batch's summed loss is divided by the tokens of the whole global batch (all
    micro-batches of all data-parallel ranks), then multiplied back by what DeepSpeed divides
    by (accumulation steps, data-parallel averaging): the step's gradient is that of
    sum(loss) / tokens over the global batch, whatever the parallel layout."""
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
        loss_sum, _, report = forward(run, batch, probe=probe and micro == 0)
        engine.backward(loss_sum * scale)
        engine.step()
        totals.add(report)
    local_loss = totals.totals["lm loss"][0]  # this rank's loss sum
    names, pairs = totals.reduced(run.dp_group)
    agreed = agree(stop, ~torch.isfinite(local_loss), writing, lost)
    # The ZeRO optimizer skips a step whose gradient norm is not finite (NaN/inf loss
    # included): no update and no schedule step. Both signs are agreed by every rank (the
    # overflow check inside DeepSpeed, the loss flag in `agree`).
    skipped = engine.skipped_steps > skipped_before or agreed.nonfinite
    return EngineStep(names, pairs, engine.get_global_grad_norm(), agreed, skipped)


class _DeepSpeed:
    """DeepSpeed's engine behind the loop's protocol (training/engines.EngineKind)."""

    name = "deepspeed"
    owner = "DeepSpeed's"

    def describe(self, cfg) -> str:
        return f"DeepSpeed (ZeRO {cfg.parallel.zero_stage})"

    def config_problem(self, cfg) -> str | None:
        return config_problem(cfg)

    def layout(self, cfg, world: int):
        return run_layout(cfg, world, self.name, zero_stage=cfg.parallel.zero_stage)

    def memory_plan(self, cfg, world: int, gpu_memory_gib: float | None):
        return memory_plan(cfg, world, gpu_memory_gib)

    def reads_data(self, cfg) -> bool:
        return True  # one stage: every rank reads its data-parallel rank's batches

    def build(self, cfg, device: torch.device, tokenizer, schedule, world: int) -> Built:
        return build(cfg, device, tokenizer, schedule, world)

    def step(self, run, micro_batches, probe, stop, writing, lost=False) -> EngineStep:
        return step(run, micro_batches, probe, stop, writing, lost)

    def score(self, run, batches):
        totals = PairSum()
        for batch in batches:
            totals.add(forward(run, batch)[2])  # {name: [sum, count]}
        return totals.totals

    def evaluation_weights(self, engine):
        return contextlib.nullcontext()  # ZeRO's weights are in place after its step

    def checkpoint_adapter(self, run):
        from .deepspeed_checkpoint import DeepSpeedAdapter

        return DeepSpeedAdapter(run.engine, zero3=run.cfg.parallel.zero_stage == 3)

    def native_state(self, engine):
        from .deepspeed_checkpoint import DeepSpeedNativeState

        return DeepSpeedNativeState(engine)


KIND = _DeepSpeed()
