"""What a checkpoint needs of an engine (`Adapter`): how its optimizer holds the layout-free
state's ranges, and its own parts of a checkpoint (its counters, its weights on the host);
and, for an engine with a state format of its own, that state (`NativeState`).

A checkpoint is written and read through one adapter, never through an engine: the caller
makes it for one save or load (training/checkpointing.py asks the run's engine for it,
training/engines/) and hands it in. optim_state.py asks it for the trained parameters
(named as the whole model names them), the range [start, stop) of each flattened
tensor-parallel shard this rank's optimizer holds (`owned`), whether this rank writes that
range (`writes`: false on a replica whose data-parallel peer writes the same), and the 1-D
fp32 master and Adam moments of that range (`get`, `put`). Adapters hold nothing between
calls.

The adapters themselves live beside their engines: training/engines/deepspeed_checkpoint.py
(DeepSpeed's ZeRO 1/2/3 partitions, its step counters, its own checkpoint files) and
training/engines/megatron_checkpoint.py (megatron-core's FP32, bf16 and distributed
optimizers over a pipeline stage's chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

# Key of the master weight in the layout-free state; the moments keep Adam's state keys.
FP32 = "fp32"


class Adapter(Protocol):
    """What the layout-free state needs of an engine (see the module's docstring)."""

    pp_rank: int | None  # this rank's pipeline stage, None at one stage

    def parameters(self) -> list[tuple[str, torch.nn.Parameter]]: ...

    def copies(self) -> list[tuple[str, torch.nn.Parameter]]: ...

    def buffers(self) -> list[tuple[str, torch.Tensor]]: ...

    def shard_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]: ...

    def owned(self, param: torch.nn.Parameter) -> tuple[int, int] | None: ...

    def writes(self, param: torch.nn.Parameter) -> bool: ...

    def get(self, param: torch.nn.Parameter, key: str) -> torch.Tensor: ...

    def put(self, param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None: ...

    def prepare(self) -> None: ...

    def adam_steps(self) -> dict[int, int]: ...

    def set_adam_step(self, step: int) -> None: ...

    def masters_to_weights(self) -> None: ...

    def counters(self, step: int, samples: int, skipped: int) -> dict[str, int]: ...

    def set_counters(self, index: dict[str, Any]) -> None: ...

    # {name: host copy} of the weights when `keep` (else {}; a ZeRO-3 gather still joined),
    # queued through host.host_copies: save.save waits for them, once a save
    def host_weights(self, keep: bool) -> dict[str, torch.Tensor]: ...

    def state_bytes(self) -> tuple[int, int]: ...


def trained_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def saved_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint keeps (persistent ones: they are in the state dict)."""
    persistent = set(module.state_dict(keep_vars=True))
    return [(name, b) for name, b in module.named_buffers() if name in persistent]


class NativeState(Protocol):
    """An engine's own optimizer state, kept instead of the layout-free state where the run
    asks (train.layout_free_checkpoints=false) and read at its saved layout only; its files
    are under `native.TAG` (checkpoint/native.py names them)."""

    def save_job(self, directory: Path, step: int) -> Callable[[], dict[str, dict[str, Any]]]:
        """Write the state now (the engine writes it itself, so such a save is not written
        behind training); the job flushes it to the disk."""
        ...

    def load(self, path: Path) -> None: ...
