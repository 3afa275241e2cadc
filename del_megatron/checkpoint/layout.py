"""The two records a save and a load are handed instead of a trainer: the parallel layout of
a run (`Layout`: engine, tensor, pipeline and virtual stages, data parallel, ZeRO), as
meta.json keeps it and as a resume compares it, and this rank's place in it (`Place`).

The caller (training/checkpointing.py) makes both from its run; the package reads no global
parallel state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the layout fields a rank's generators belong to: a resume with any of them changed draws
# new seeds (load.py)
POSITION_FIELDS = (
    "tensor_parallel",
    "pipeline_parallel",
    "virtual_pipeline_parallel",
    "data_parallel",
)
# the engine of a checkpoint that recorded none (saved before there were two): said without
# its name, as the default train.engine is
FIRST_ENGINE = "deepspeed"


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout. zero_stage: the deepspeed engine's ZeRO stage (None: the
    megatron engine, or a checkpoint saved before it was recorded); tensor_parallel and
    data_parallel None only in a checkpoint saved before they were recorded."""

    engine: str
    tensor_parallel: int | None
    pipeline_parallel: int = 1
    virtual_pipeline_parallel: int | None = None
    data_parallel: int | None = None
    zero_stage: int | None = None

    @classmethod
    def saved(cls, meta: dict[str, Any]) -> Layout:
        """The layout a checkpoint was saved at (no engine or pipeline recorded: the
        deepspeed engine's single stage, all there was)."""
        return cls(
            engine=meta.get("engine", FIRST_ENGINE),
            tensor_parallel=meta.get("tensor_parallel"),
            pipeline_parallel=meta.get("pipeline_parallel", 1),
            virtual_pipeline_parallel=meta.get("virtual_pipeline_parallel"),
            data_parallel=meta.get("data_parallel"),
            zero_stage=meta.get("zero_stage"),
        )

    def meta(self) -> dict[str, Any]:
        """meta.json's layout fields (`saved` reads them back)."""
        return {
            "data_parallel": self.data_parallel,
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "virtual_pipeline_parallel": self.virtual_pipeline_parallel,
            "engine": self.engine,
            "zero_stage": self.zero_stage,
        }

    def differs_from(self, saved: Layout) -> bool:
        """Whether this is another layout than `saved`, which an engine's own per-rank state
        cannot serve (an unrecorded ZeRO stage is taken as unchanged: the engine itself then
        says whether its state loads)."""
        return any(
            getattr(saved, key) != getattr(self, key)
            for key in (*POSITION_FIELDS, "engine", "zero_stage")
            if getattr(saved, key) is not None or key != "zero_stage"
        )

    def same_positions(self, saved: Layout) -> bool:
        """Whether every rank has the same place in the model as when saved (its generators'
        states then are its own): the same tensor, pipeline and data-parallel sizes."""
        return all(getattr(saved, key) == getattr(self, key) for key in POSITION_FIELDS)

    def describe(self) -> str:
        zero = "" if self.zero_stage is None else f", ZeRO {self.zero_stage}"
        stages = ""
        if self.pipeline_parallel > 1:
            stages = f" x pipeline parallel {self.pipeline_parallel}"
            if self.virtual_pipeline_parallel:
                stages += f" ({self.virtual_pipeline_parallel} virtual)"
        engine = "" if self.engine == FIRST_ENGINE else f" ({self.engine} engine)"
        return (
            f"tensor parallel {self.tensor_parallel}{stages} x data parallel "
            f"{self.data_parallel}{zero}{engine}"
        )

    def how_to_run(self, world: Any, engine: str) -> str:
        """The overrides of this (saved) layout for a run now on `engine` (named when it
        differs: an engine's own state is that engine's)."""
        zero = "" if self.zero_stage is None else f" parallel.zero_stage={self.zero_stage}"
        other = "" if self.engine == engine else f"train.engine={self.engine} "
        return f"{other}parallel.tensor_parallel={self.tensor_parallel}{zero} on {world} processes"


@dataclass(frozen=True)
class Place:
    """This rank's place in the run: its global rank of `world`, its tensor-parallel,
    pipeline and data-parallel ranks, and its data-parallel group (the data state's gather
    runs on it; None: the default group)."""

    rank: int
    world: int
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    dp_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def writes_weights(self) -> bool:
        """Whether this rank writes its stage's tensor-parallel shard of the weights (and,
        with `writes_data_state`, sends its data-parallel rank's loader record): the first
        data-parallel rank holds what its replicas hold."""
        return self.dp_rank == 0

    @property
    def writes_data_state(self) -> bool:
        """Whether this rank sends its data-parallel rank's loader record: the first
        tensor-parallel rank of the first pipeline stage (its peers read the same batches)."""
        return self.tp_rank == 0 and self.pp_rank == 0
