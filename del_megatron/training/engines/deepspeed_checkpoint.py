"""The DeepSpeed engine's adapter: its ZeRO optimizer's ranges of the layout-free state, its
step counters, its weights on the host (ZeRO 3 gathers them), and its own checkpoint files
(train.layout_free_checkpoints=false: DeepSpeed's per-rank state, read at its saved layout).

This data-parallel rank's own piece of a parameter's fp32 master and Adam moments is read
and written without a collective: which flattened range [start, stop) of the parameter's
tensor-parallel shard the rank's ZeRO partition holds, and that range's tensors.

* **ZeRO 1 and 2** (and DeepSpeed's BF16_Optimizer): the flat fp32 partition of a rank
  covers a contiguous range of the parameters of its group laid end to end; DeepSpeed maps
  each parameter that overlaps it to a `tensor_fragment` (`param._hp_mapping`, None where
  the rank holds none of it) whose `lp_fragment_address` (start, numel) is the range in the
  flattened parameter and whose `get_hp_fragment(key)` is the 1-D view of the master (key
  None) or a moment, linked by `ensure_adam_state`.
* **ZeRO 3**: every parameter is cut on its own into `partition_numel()` elements per rank
  (the last rank's piece padded past `ds_numel`); rank r (`ds_zero_partition_rank`) holds
  [r * partition_numel, ...), read and written through DeepSpeed's local API
  (`safe_get_local_fp32_param` / `safe_get_local_optimizer_state` and their setters), which
  take and give the padded piece.

DeepSpeed 0.19.8's local API covers ZeRO 3 only; the ZeRO 1/2 fragment mapping is the one
its `safe_get_full_*` reads before it all-reduces (deepspeed/utils/tensor_fragment.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...checkpoint import writer
from ...checkpoint.adapter import FP32, saved_buffers, trained_parameters
from ...checkpoint.directory import CheckpointError
from ...checkpoint.host import host_copies
from ...checkpoint.native import TAG
from ...errors import one_line


@dataclass(frozen=True)
class DeepSpeedAdapter:
    """The layout-free state's view of a DeepSpeed engine (checkpoint/adapter.Adapter)."""

    engine: Any
    zero3: bool
    pp_rank: int | None = None  # the deepspeed engine runs one pipeline stage

    def parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return trained_parameters(self.engine.module)

    def copies(self) -> list[tuple[str, torch.nn.Parameter]]:
        return []  # one stage: a tied output layer is the embedding itself

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        return saved_buffers(self.engine.module)

    def shard_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        return full_shape(param)

    def owned(self, param: torch.nn.Parameter) -> tuple[int, int] | None:
        return owned(param)

    def writes(self, param: torch.nn.Parameter) -> bool:
        return True  # ZeRO partitions are disjoint over data-parallel ranks

    def get(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        return get(param, key)

    def put(self, param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
        put(param, key, value)

    def prepare(self) -> None:
        ensure_adam_state(self.engine.optimizer)

    def adam_steps(self) -> dict[int, int]:
        return adam_steps(self.engine.optimizer)

    def set_adam_step(self, step: int) -> None:
        _set_adam_step(self.engine.optimizer, step)

    def masters_to_weights(self) -> None:
        _model_weights_from_masters(self.engine.optimizer)

    def counters(self, step: int, samples: int, skipped: int) -> dict[str, int]:
        """DeepSpeed's own counters (the loop's arguments are for engines without any)."""
        engine = self.engine
        return {
            "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples),
            "skipped_steps": int(engine.skipped_steps),
        }

    def set_counters(self, index: dict[str, Any]) -> None:
        self.engine.global_steps = int(index["global_steps"])
        self.engine.global_samples = int(index["global_samples"])
        self.engine.skipped_steps = int(index["skipped_steps"])

    def host_weights(self, keep: bool) -> dict[str, torch.Tensor]:
        return host_weights(self.engine.module, self.zero3, keep)

    def state_bytes(self) -> tuple[int, int]:
        """(this rank's trained elements of its tensor-parallel shard, their element size):
        ZeRO 3 leaves empty placeholders and keeps the count in `ds_numel`."""
        params = [p for _, p in self.parameters()]
        return sum(getattr(p, "ds_numel", p.numel()) for p in params), params[0].element_size()


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The tensor-parallel rank's shape of a parameter (ZeRO-3 parameters are empty
    placeholders outside a gather and carry their shape in `ds_shape`)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def _flat_groups(zero: Any) -> list[tuple[list[torch.nn.Parameter], torch.Tensor]]:
    """(the parameters, the flat fp32 partition Adam steps) of each group of a ZeRO optimizer:
    stage 1/2 name them bit16_groups / single_partition_of_fp32_groups, stage 3 fp16_groups /
    fp32_partitioned_groups_flat, and DeepSpeed's BF16_Optimizer (stage 1 of a bf16 run that
    sums gradients in float32, config.deepspeed_config) bf16_groups /
    fp32_groups_flat_partition."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return list(zip(zero.fp16_groups, zero.fp32_partitioned_groups_flat, strict=True))
    if hasattr(zero, "fp32_groups_flat_partition"):
        return list(zip(zero.bf16_groups, zero.fp32_groups_flat_partition, strict=True))
    return list(zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True))


def adam_steps(zero: Any) -> dict[int, int]:
    """id(parameter) -> Adam's step count for its group (0 before the first step)."""
    steps = {}
    for params, flat in _flat_groups(zero):
        step = zero.optimizer.state.get(flat, {}).get("step", 0)
        for p in params:
            steps[id(p)] = int(step)
    return steps


def ensure_adam_state(zero: Any) -> None:
    """Give every group Adam's state as torch's AdamW creates it lazily at the first step (a
    fresh engine, or one whose steps so far were all skipped as non-finite, has none, and
    DeepSpeed's getters and setters read and write into it), then link each ZeRO 1/2
    parameter's fragments of the moments.

    The link is made every time: DeepSpeed 0.19.8's ZeRO 1/2 `load_checkpoint` rebuilds the
    parameters' fragment mappings without their moments and keeps its flag saying they are
    linked, so after a same-layout resume `safe_get_full_optimizer_state` fails until this."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for params, flat in _flat_groups(zero):
        state = zero.optimizer.state[flat]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        if not hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO 3 reads the state itself
            lazy_init_hp_params_optimizer_state(params, flat, zero.optimizer.state)
    if hasattr(zero, "_hp_optimizer_states_linked"):
        zero._hp_optimizer_states_linked = True


def _set_adam_step(zero: Any, step: int) -> None:
    state = zero.optimizer.state
    for _, flat in _flat_groups(zero):
        if isinstance(state[flat]["step"], torch.Tensor):
            state[flat]["step"].fill_(step)
        else:
            state[flat]["step"] = step


def _model_weights_from_masters(zero: Any) -> None:
    """Copy the fp32 masters into the model's (training dtype) weights, as DeepSpeed does
    after a step: ZeRO 1/2 copy each partition and all-gather; ZeRO 3 copies each rank's
    partition (the model gathers it when it runs)."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        for lp_flat, fp32_flat in zip(
            zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat, strict=True
        ):
            if lp_flat is not None and fp32_flat.numel():
                lp_flat.data.copy_(fp32_flat.data)
    else:
        zero.update_lp_params()


def _zero3(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def owned(param: torch.nn.Parameter) -> tuple[int, int] | None:
    """[start, stop) of the flattened tensor-parallel shard whose master and moments this
    rank's ZeRO partition holds; None where it holds none of the parameter."""
    if _zero3(param):
        size = param.partition_numel()
        start = min(param.ds_zero_partition_rank * size, param.ds_numel)
        stop = min(start + size, param.ds_numel)
    else:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        start = mapping.lp_fragment_address.start
        stop = start + mapping.lp_fragment_address.numel
    return (start, stop) if stop > start else None


def get(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """The 1-D [stop - start] master (key FP32) or moment of this rank's range (`owned`),
    where the optimizer keeps it (a view, not a copy)."""
    start, stop = owned(param)
    if _zero3(param):
        return _local_piece(param, key).narrow(0, 0, stop - start)
    return param._hp_mapping.get_hp_fragment(None if key == FP32 else key)


def put(param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
    """Set this rank's range (`owned`) of the master or a moment to the 1-D `value`."""
    start, stop = owned(param)
    if value.shape != (stop - start,):
        raise ValueError(f"a fragment of {stop - start} elements set from {tuple(value.shape)}")
    if _zero3(param):
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        # DeepSpeed's piece is padded to partition_numel: keep what the padding holds
        padded = _local_piece(param, key).clone()
        padded[: stop - start] = value.to(padded.device)
        if key == FP32:
            safe_set_local_fp32_param(param, padded)
        else:
            safe_set_local_optimizer_state(param, padded, key)
        return
    fragment = param._hp_mapping.get_hp_fragment(None if key == FP32 else key)
    fragment.data.copy_(value.to(fragment.device))


def _local_piece(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """ZeRO 3's whole local piece (partition_numel elements, the padding included)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    if key == FP32:
        return safe_get_local_fp32_param(param)
    return safe_get_local_optimizer_state(param, key)


# ---- DeepSpeed's own checkpoint files (train.layout_free_checkpoints=false) -------------


def host_weights(module: torch.nn.Module, zero3: bool, keep: bool) -> dict[str, torch.Tensor]:
    """{name: host copy} of this rank's parameters when `keep` (else {}), queued
    (checkpoint/host.host_copies: the save waits for them once). Under ZeRO 3 every
    data-parallel rank takes part in gathering each parameter (a collective), one parameter
    at a time: a device holds its shard of the model plus one whole parameter, never the
    whole model (each copy is queued inside its parameter's gather)."""
    import deepspeed

    names = [name for name, _ in module.named_parameters()]

    def gathered():
        for _, param in module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], enabled=zero3):
                yield param.detach()

    if not keep:
        for _ in gathered():  # the gathers, which every rank joins
            pass
        return {}
    # copies: the next step changes the parameters (on CPU, in place)
    return dict(zip(names, host_copies(gathered()), strict=True))


@dataclass(frozen=True)
class DeepSpeedNativeState:
    """DeepSpeed's own per-rank state (checkpoint/adapter.NativeState), under native.TAG."""

    engine: Any

    def save_job(self, directory: Path, step: int) -> writer.Job:
        return native_save(self.engine, directory, step)

    def load(self, path: Path) -> None:
        native_load(self.engine, path)


def native_save(engine: Any, directory: Path, step: int) -> writer.Job:
    """DeepSpeed's own per-rank state written now (DeepSpeed writes it itself, so such a save
    is not written behind training); the job flushes it to the disk before the rename. Its
    files are hashed at the publish (`files.write_index`), shared over the ranks."""
    engine.save_checkpoint(str(directory), tag=TAG, client_state={"step": step}, save_latest=False)

    def flush() -> dict[str, dict[str, Any]]:
        for path in (directory / TAG).rglob("*"):
            if path.is_file():
                writer.fsync(path)
        return {}

    return flush


def native_load(engine: Any, path: Path) -> None:
    """DeepSpeed's own per-rank state, at its saved layout (bit-exact resume)."""
    try:
        loaded, _ = engine.load_checkpoint(
            str(path),
            tag=TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=True,
        )
    except Exception as err:  # DeepSpeed raises whatever its torch.load or asserts raise
        raise CheckpointError(
            f"{path}: cannot load the model/optimizer state "
            f"({type(err).__name__}: {one_line(str(err))[:300]})"
        ) from None
    if loaded is None:
        raise CheckpointError(f"{path}: no DeepSpeed state under tag '{TAG}'")
    # DeepSpeed's ZeRO 1/2 load unlinks the moments from its safe_get API, which the next
    # layout-free save reads them through
    ensure_adam_state(engine.optimizer)
