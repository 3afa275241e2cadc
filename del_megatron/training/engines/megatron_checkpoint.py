"""The megatron engine's adapter (train.engine=megatron, training/engines/megatron.py): where
megatron-core's optimizer keeps each parameter's fp32 master and Adam moments, over this
rank's pipeline stage (its model chunks, parameters named as the whole model names them:
models/sharding.global_name).

* **FP32 optimizer** (CPU, float32): the parameters are the masters; every data-parallel
  rank holds the whole of each, and rank 0 writes it (`writes`).
* **bf16 optimizer without the distributed optimizer**: `fp32_from_float16_groups` beside
  `float16_groups` (and `fp32_from_fp32_groups` for float32 parameters).
* **Distributed optimizer** (GPU): each data-parallel rank's shard main parameter holds the
  range `param_map[p]["param"]` of the flattened parameter (`_get_model_param_range_map`),
  the ranges disjoint over ranks, as DeepSpeed's ZeRO fragments; after a load the masters
  reach the weights as after megatron's step (`_copy_main_params_to_model_params`, then the
  parameter all-gather).

Adam's moments are `optimizer.state[main]["exp_avg"]` and `["exp_avg_sq"]`; the step is in
that state for torch's Adam and AdamW (CPU, or a GPU without Transformer Engine and apex),
and in the parameter group for the fused Adams megatron picks first on GPU (Transformer
Engine's, apex's): `_steps_in_state`. The GPU paths follow megatron-core 0.16.1's and 0.19's
sources line by line (the attributes read here exist in both) and have not run yet.

A tied embedding at pipeline parallel > 1 has a copy on the last stage (its output layer),
kept equal by megatron (gradients all-reduced over the embedding group): the first stage
writes it, and a load sets the copy from the same entry (`copies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...checkpoint.adapter import FP32, saved_buffers
from ...checkpoint.host import host_copies
from ...models.sharding import global_name


@dataclass(frozen=True)
class _Holder:
    """Where one model parameter's master and state live on this rank."""

    optimizer: Any  # the torch optimizer whose state holds `main`
    main: torch.Tensor  # the fp32 master (the parameter itself for the FP32 optimizer)
    span: tuple[int, int] | None  # the distributed optimizer's range; None: all of it
    owner: Any  # the megatron optimizer (masters to weights)


def _holders(optimizer: Any) -> dict[int, _Holder]:
    """id(model parameter) -> its `_Holder`, for each megatron optimizer (one, or chained;
    a stub optimizer, on a rank with nothing to train, holds none)."""
    found: dict[int, _Holder] = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "is_stub_optimizer", False) or inner.optimizer is None:
            continue
        torch_optimizer = inner.optimizer
        if hasattr(inner, "model_param_gbuf_map"):  # the distributed optimizer
            # the pairs megatron's own copy between masters and weights uses (the torch
            # group lists fp32 shards before bf16 ones: not the buffer's order)
            pairs = [
                *zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups, strict=True),
                *zip(inner.model_fp32_groups, inner.shard_fp32_groups, strict=True),
            ]
            for models, mains in pairs:
                for param, main in zip(models, mains, strict=True):
                    span = inner._get_model_param_range_map(param)["param"]
                    if main.numel() != span.end - span.start:
                        raise RuntimeError(
                            f"megatron's shard of a parameter holds {main.numel()} elements, "
                            f"its range {span.start}:{span.end}"
                        )
                    found[id(param)] = _Holder(torch_optimizer, main, (span.start, span.end), inner)
        elif hasattr(inner, "float16_groups"):  # bf16 / fp16 with fp32 masters
            for models, mains in zip(
                inner.float16_groups, inner.fp32_from_float16_groups, strict=True
            ):
                for param, main in zip(models, mains, strict=True):
                    found[id(param)] = _Holder(torch_optimizer, main, None, inner)
            for group in inner.fp32_from_fp32_groups:
                for param in group:
                    found[id(param)] = _Holder(torch_optimizer, param, None, inner)
        else:  # FP32Optimizer: the parameters are the masters
            for group in torch_optimizer.param_groups:
                for param in group["params"]:
                    found[id(param)] = _Holder(torch_optimizer, param, None, inner)
    return found


def _steps_in_state(optimizer: Any) -> bool:
    """torch's Adam and AdamW count the step per parameter in its state; the fused Adams
    megatron prefers on GPU (Transformer Engine's, apex's) per group."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)


def _is_tied_copy(chunk: torch.nn.Module, name: str) -> bool:
    """The last stage's output layer of a tied model at pipeline parallel > 1 (at one stage
    megatron allocates no such weight)."""
    return (
        name == "output_layer.weight"
        and chunk.share_embeddings_and_output_weights
        and not chunk.pre_process
    )


@dataclass
class MegatronAdapter:
    """The layout-free state's view of a MegatronEngine (checkpoint/adapter.Adapter)."""

    engine: Any  # training/engines/megatron.MegatronEngine
    dp_rank: int
    pp_rank: int | None = field(init=False)
    holders: dict[int, _Holder] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from megatron.core import parallel_state

        stages = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank() if stages > 1 else None
        self.holders = _holders(self.engine.optimizer)

    def _named(self, copies: bool) -> list[tuple[str, torch.nn.Parameter]]:
        return [
            (global_name(chunk, name), param)
            for chunk in self.engine.modules
            for name, param in chunk.named_parameters()
            if param.requires_grad and _is_tied_copy(chunk, name) == copies
        ]

    def parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self._named(copies=False)

    def copies(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self._named(copies=True)

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (global_name(chunk, name), buffer)
            for chunk in self.engine.modules
            for name, buffer in saved_buffers(chunk)
        ]

    def shard_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        return tuple(param.shape)

    def owned(self, param: torch.nn.Parameter) -> tuple[int, int] | None:
        holder = self.holders.get(id(param))
        if holder is None:
            return None
        return holder.span or (0, param.numel())

    def writes(self, param: torch.nn.Parameter) -> bool:
        """A distributed optimizer's ranges are disjoint; otherwise data-parallel rank 0's."""
        holder = self.holders.get(id(param))
        return holder is not None and (holder.span is not None or self.dp_rank == 0)

    def get(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        holder = self.holders[id(param)]
        if key == FP32:
            return holder.main.data.view(-1)
        return holder.optimizer.state[holder.main][key].view(-1)

    def put(self, param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
        target = self.get(param, key)
        if value.shape != target.shape:
            raise ValueError(f"a range of {target.numel()} elements set from {tuple(value.shape)}")
        with torch.no_grad():
            target.copy_(value.to(target.device, target.dtype))

    def _optimizers(self) -> list[Any]:
        unique = {id(h.optimizer): h.optimizer for h in self.holders.values()}
        return list(unique.values())

    def prepare(self) -> None:
        """Adam's state as the optimizer makes it at its first step (a fresh engine, or one
        whose steps so far were all skipped as non-finite, has none): both moments, zero,
        and for torch's Adam the step in the state, where torch keeps it (on the device when
        the group is capturable or fused); a fused Adam keeps it in the group (`set_adam_step`)."""
        for optimizer in self._optimizers():
            in_state = _steps_in_state(optimizer)
            for group in optimizer.param_groups:
                on_device = group.get("capturable") or group.get("fused")
                for main in group["params"]:
                    state = optimizer.state[main]
                    if state:
                        continue
                    if in_state:
                        device = main.device if on_device else None
                        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros_like(main, memory_format=torch.preserve_format)

    def adam_steps(self) -> dict[int, int]:
        steps = {}
        for key, holder in self.holders.items():
            if _steps_in_state(holder.optimizer):
                step = holder.optimizer.state.get(holder.main, {}).get("step", 0)
            else:
                group = next(
                    g
                    for g in holder.optimizer.param_groups
                    if any(p is holder.main for p in g["params"])
                )
                step = group.get("step", 0)
            steps[key] = int(step.item() if isinstance(step, torch.Tensor) else step)
        return steps

    def set_adam_step(self, step: int) -> None:
        for optimizer in self._optimizers():
            in_state = _steps_in_state(optimizer)
            for group in optimizer.param_groups:
                if not in_state:  # a fused Adam's count, as it keeps it
                    held = group.get("step")
                    if isinstance(held, torch.Tensor):
                        held.fill_(step)
                    elif getattr(optimizer, "capturable", False):
                        device = group["params"][0].device
                        group["step"] = torch.tensor([step], dtype=torch.int, device=device)
                    else:
                        group["step"] = step
                    continue
                for main in group["params"]:
                    state = optimizer.state[main]
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"].fill_(step)
                    else:
                        state["step"] = torch.tensor(float(step))

    def masters_to_weights(self) -> None:
        """The model's weights from the masters, as megatron's step leaves them: the bf16
        copies, and with the distributed optimizer the parameter all-gather, which every
        data-parallel rank joins (decided by the engine's config, not by what this rank
        holds: a rank whose shard is padding only joins it too)."""
        owners = {id(h.owner): h.owner for h in self.holders.values()}.values()
        with torch.no_grad():
            for owner in owners:
                if hasattr(owner, "_copy_main_params_to_model_params"):
                    owner._copy_main_params_to_model_params()
            for chunk in self.engine.chunks:
                if chunk.ddp_config.use_distributed_optimizer:
                    chunk.start_param_sync(force_sync=True)

    def counters(self, step: int, samples: int, skipped: int) -> dict[str, int]:
        """The step counters the deepspeed engine keeps, from the loop's (a checkpoint of
        either engine resumes in the other)."""
        return {"global_steps": step, "global_samples": samples, "skipped_steps": skipped}

    def set_counters(self, index: dict[str, Any]) -> None:
        """megatron's engine keeps no counters of its own: the loop's step is the record's."""

    def host_weights(self, keep: bool) -> dict[str, torch.Tensor]:
        """{global name: host copy} of this stage's parameters when `keep`, gathered first
        where the last step's gather waits for the next forward (`synced_weights`); queued
        (checkpoint/host.host_copies: the save waits for them once)."""
        from .megatron import synced_weights

        with synced_weights(self.engine):
            params = self.parameters() if keep else []
            copies = host_copies(param.detach() for _, param in params)
            return dict(zip([name for name, _ in params], copies, strict=True))

    def state_bytes(self) -> tuple[int, int]:
        """(trained elements of this rank's tensor-parallel shard over the whole pipeline,
        estimated as this stage's times the stages; their element size)."""
        from megatron.core import parallel_state

        params = [p for _, p in self.parameters()]
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        return sum(p.numel() for p in params) * stages, params[0].element_size()
