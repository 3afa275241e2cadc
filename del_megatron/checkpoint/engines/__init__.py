"""Engine adapters: how an engine's optimizer holds the layout-free state's ranges, and the
engine's own parts of a checkpoint (its counters, its weights on the host, its native state).

A checkpoint is written and read through one adapter (`adapter_of`), never through an
engine: optim_state.py asks it for the trained parameters (named as the whole model names
them), the range [start, stop) of each flattened tensor-parallel shard this rank's optimizer
holds (`owned`), whether this rank writes that range (`writes`: false on a replica whose
data-parallel peer writes the same), and the 1-D fp32 master and Adam moments of that range
(`get`, `put`). Adapters are made for one save or load and hold nothing between calls.

* engines/deepspeed.py: DeepSpeed's ZeRO 1/2/3 partitions (a rank's fragments of its
  flat groups), its step counters and its own checkpoint files.
* engines/megatron.py: megatron-core's optimizers: the FP32 optimizer (the parameters are
  the masters; every data-parallel rank holds all of them, rank 0 writes), the bf16 one with
  fp32 masters, and the distributed optimizer (each rank's range of each parameter,
  `param_map[p]["param"]`, as DeepSpeed's fragments), over the pipeline stage's chunks.
"""

from __future__ import annotations

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

    def host_weights(self, keep: bool) -> dict[str, torch.Tensor]: ...

    def state_bytes(self) -> tuple[int, int]: ...


def trained_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def saved_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint keeps (persistent ones: they are in the state dict)."""
    persistent = set(module.state_dict(keep_vars=True))
    return [(name, b) for name, b in module.named_buffers() if name in persistent]


def adapter_of(run: Any) -> Adapter:
    """The adapter of the run's engine (train.engine), for one save or load."""
    if run.cfg.train.engine == "megatron":
        from .megatron import MegatronAdapter

        return MegatronAdapter(run.engine, dp_rank=run.dp_rank)
    from .deepspeed import DeepSpeedAdapter

    return DeepSpeedAdapter(run.engine, zero3=run.cfg.parallel.zero_stage == 3)
