"""What a run is doing, said before each part that can take more than a few seconds (the
model and optimizer, a checkpoint to load, a held-out evaluation, the first steps), so that
the console is never silent for long. Rank 0 of the launch says it, once, and flushes: under
torchrun and srun the line must not wait in a pipe buffer."""

from __future__ import annotations

import os

from ..config import RunConfig


def say(message: str) -> None:
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"del-train: {message}", flush=True)


def engine_name(cfg: RunConfig) -> str:
    if cfg.train.engine == "megatron":
        return "megatron-core's engine"
    return f"DeepSpeed (ZeRO {cfg.parallel.zero_stage})"


def building(cfg: RunConfig, world: int) -> None:
    say(f"building the model and {engine_name(cfg)} on {world} rank(s), {cfg.layout_text(world)}")


def model_built(cfg: RunConfig, parameters: int) -> None:
    """Between the model and the engine: DeepSpeed's import and set-up take most of a first
    start's half minute, which a user would otherwise watch in silence."""
    engine = "megatron-core's" if cfg.train.engine == "megatron" else "DeepSpeed's"
    say(f"model built ({parameters:,} parameters); starting {engine} engine")


def held_out(cfg: RunConfig, when: str) -> None:
    if cfg.eval.sources:
        say(f"held-out evaluation {when} ({cfg.eval.max_batches} batches at most)")


def steps(cfg: RunConfig, start: int) -> None:
    say(f"training steps {start + 1}-{cfg.train.steps}, a line every {cfg.train.log_interval}")
