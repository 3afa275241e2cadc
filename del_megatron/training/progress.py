"""What a run is doing, said before each part that can take more than a few seconds (the
model and optimizer, a checkpoint to load, a held-out evaluation, the first steps), so that
the console is never silent for long. Rank 0 of the launch says it, once, and flushes: under
torchrun and srun the line must not wait in a pipe buffer."""

from __future__ import annotations

from ..config import RunConfig
from ..parallel import launch_rank


def say(message: str) -> None:
    if launch_rank() == 0:
        print(f"del-train: {message}", flush=True)


def building(cfg: RunConfig, world: int) -> None:
    from .engines import kind_of

    engine = kind_of(cfg.train.engine).describe(cfg)
    say(f"building the model and {engine} on {world} rank(s), {cfg.layout_text(world)}")


def model_built(parameters: int, owner: str) -> None:
    """Between the model and the engine: DeepSpeed's import and set-up take most of a first
    start's half minute, which a user would otherwise watch in silence. owner: whose engine
    ("DeepSpeed's")."""
    say(f"model built ({parameters:,} parameters); starting {owner} engine")


def held_out(cfg: RunConfig, when: str) -> None:
    if cfg.eval.sources:
        say(f"held-out evaluation {when} ({cfg.eval.max_batches} batches at most)")


def steps(cfg: RunConfig, start: int) -> None:
    say(f"training steps {start + 1}-{cfg.train.steps}, a line every {cfg.train.log_interval}")
