"""The engines that run a training step (train.engine), each one component behind one
protocol (`EngineKind`), and the registry (`KINDS`): the one place an engine's name is read.

The loop (training/trainer.py) asks the run's kind for everything that differs between
engines and names none:

* before anything is built: the config problems it refuses (`config_problem`, asked by the
  run config's own check), its one-line description, the checkpoint layout of a run on it,
  its memory plan (`--dry-run`), whether this rank reads the training data;
* `build`: the model and the engine around it on this rank, and the learning-rate scheduler;
* `step`: one optimizer step over this rank's micro-batches (`EngineStep`, the same for
  every engine); `score`: one held-out batch's report; `evaluation_weights`: the weights of
  the last step, for a forward outside the step;
* checkpoints: `checkpoint_adapter` (checkpoint/adapter.Adapter, the module beside the
  engine: `<name>_checkpoint.py`) and `native_state` (its own state format, if it has one).

Each engine is one module here: `deepspeed.py` (DeepSpeed's ZeRO engine: its set-up, step,
generated JSON, ZeRO memory plan, native state) and `megatron.py` (megatron-core's own
engine: stage building, its DDP and optimizer choices, schedules, stage plan). A third
engine is one new module with its `KIND` and one line in `KINDS`.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ...checkpoint.adapter import Adapter, NativeState
    from ...checkpoint.layout import Layout
    from ...config import RunConfig
    from ..plan import Plan
    from ..signals import Agreement, StopRequest

# name -> the module whose `KIND` is that engine: the one table of engines
KINDS: dict[str, str] = {
    "deepspeed": "del_megatron.training.engines.deepspeed",
    "megatron": "del_megatron.training.engines.megatron",
}
NAMES = tuple(KINDS)  # the values train.engine takes
DEFAULT = "deepspeed"


def kind_of(name: str) -> EngineKind:
    """The engine called `name` (one of NAMES)."""
    return importlib.import_module(KINDS[name]).KIND


def run_layout(cfg: RunConfig, world: int, engine: str, zero_stage: int | None) -> Layout:
    """The checkpoint layout of a run of `cfg` on `world` ranks on `engine` (what
    `EngineKind.layout` returns; zero_stage: the engine's ZeRO stage, None without one)."""
    from ...checkpoint.layout import Layout

    parallel = cfg.parallel
    return Layout(
        engine=engine,
        tensor_parallel=parallel.tensor_parallel,
        pipeline_parallel=parallel.pipeline_parallel,
        virtual_pipeline_parallel=parallel.virtual_pipeline_parallel,
        data_parallel=cfg.data_parallel_size(world),
        zero_stage=zero_stage,
    )


@dataclass
class EngineStep:
    """One step's outcome as the loop reads it, the same for every engine."""

    names: list[str]
    pairs: torch.Tensor  # [metrics, 2] float64, reduced over data-parallel ranks
    grad_norm: float | torch.Tensor | None  # before clipping
    agreed: Agreement
    skipped: bool  # agreed: no update this step


@dataclass
class Built:
    """What `EngineKind.build` returns: the engine the loop steps (DeepSpeed's engine, or
    megatron's chunks and optimizer), its learning-rate scheduler (LambdaLR's interface),
    and the model's parameter count (all tensor-parallel shards)."""

    engine: Any
    scheduler: Any
    parameters: int


class EngineKind(Protocol):
    """One engine: how it is described, checked, planned, built, stepped and saved. Stateless:
    what a call needs is an argument (the run, or the built engine)."""

    name: str
    owner: str  # whose engine, in a sentence: "DeepSpeed's", "megatron-core's"

    def describe(self, cfg: RunConfig) -> str:
        """One line: the engine and its main setting ('DeepSpeed (ZeRO 2)')."""
        ...

    def config_problem(self, cfg: RunConfig) -> str | None:
        """What this engine cannot do with the rest of the config, in one line (None:
        nothing)."""
        ...

    def layout(self, cfg: RunConfig, world: int) -> Layout:
        """The checkpoint layout of a run of `cfg` on `world` ranks."""
        ...

    def memory_plan(self, cfg: RunConfig, world: int, gpu_memory_gib: float | None) -> Plan:
        """Bytes per GPU of the rank that needs the most (training/plan.py's terms)."""
        ...

    def reads_data(self, cfg: RunConfig) -> bool:
        """Whether this rank reads the training data (megatron's parallel state set)."""
        ...

    def build(self, cfg: RunConfig, device: torch.device, tokenizer, schedule, world: int) -> Built:
        """This rank's model and engine, initial weights loaded (parallel state set)."""
        ...

    def step(
        self,
        run,
        micro_batches: list[dict[str, torch.Tensor] | None],
        probe: bool,
        stop: StopRequest | None,
        writing: bool,
        lost: bool = False,
    ) -> EngineStep:
        """One optimizer step over this rank's micro-batches (host tensors; None on a stage
        that reads no data); the step's agreement (`signals.agree`, with `writing` and
        `lost`) inside."""
        ...

    def score(self, run, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Held-out micro-batches' report {name: [sum, count]}, summed over them (forward
        only; as many as a training step's, so a pipeline fills as in training)."""
        ...

    def evaluation_weights(self, engine: Any) -> AbstractContextManager:
        """Around a forward or a read outside the step: the last step's weights in place."""
        ...

    def checkpoint_adapter(self, run) -> Adapter:
        """The layout-free state's view of the run's engine, for one save or load."""
        ...

    def native_state(self, engine: Any) -> NativeState | None:
        """The engine's own state format (train.layout_free_checkpoints=false); None: it has
        none."""
        ...
