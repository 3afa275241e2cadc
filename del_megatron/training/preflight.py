"""Checks of a run against its environment, before anything starts: world size, device,
tokenizer, initial weights, data manifests. Each failure is a ConfigError with one line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..config import ConfigError, RunConfig
from ..data import DataError
from ..data.format import load_manifests
from ..data.state import check_resumable
from ..losses.vocab import TokenizerError
from ..runtime import deterministic_problem, resolve_device
from .initial_weights import open_initial_weights


def launch_world_size() -> int:
    """The number of ranks this process is one of (torchrun's or SLURM's variables; 1 alone)."""
    from ..parallel import rank_environment

    rank_environment()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _writable(directory: Path) -> None:
    """output_dir can be created and written: a file is made and removed in it, or in the
    nearest directory above it where it will be made (outputs.check_output_dir). Tried, not
    predicted from access(), which says yes to root where the filesystem refuses."""
    from ..errors import UserError
    from ..outputs import check_output_dir

    try:
        check_output_dir(directory, "output_dir")
    except UserError as err:
        raise ConfigError(str(err)) from None


def _resume_point(
    cfg: RunConfig, resume: str, fingerprint: str, world: int
) -> tuple[int | None, list[str]]:
    """The step a run resumes at (None: from the start) and the lines saying what the resume
    changes (training/resume_changes.py, which refuses what may not change); refuses a fresh
    start over another run's checkpoints, which it would mix with and prune."""
    from ..checkpoint import directory
    from . import checkpointing, resume_changes

    try:
        path = directory.resolve(resume, cfg.output_dir)
        if path is not None:
            changes = resume_changes.review(path, cfg, resume, tokenizer=fingerprint)
            step = checkpointing.check(path, cfg, fingerprint, world)["step"]
            check_resumable(
                directory.data_state(path),
                cfg.data_parallel_size(world),
                cfg.data.num_workers,
                len(cfg.data.sources),
            )
            return step, changes.lines
    except directory.CheckpointError as err:
        raise ConfigError(f"--resume {resume}: {err}") from None
    except DataError as err:
        raise ConfigError(f"--resume {resume}: {path}: {err}") from None
    found = directory.complete_checkpoints(directory.root_of(cfg.output_dir))
    if resume == "none" and found:
        raise ConfigError(
            f"output_dir={cfg.output_dir} holds checkpoints of an earlier run (newest "
            f"{found[-1].name}): --resume auto to continue it, or choose another output_dir"
        )
    return None, []


def preflight(
    cfg: RunConfig,
    world_size: int | None = None,
    *,
    device_here: bool = True,
    resume: str = "none",
) -> dict[str, Any]:
    """The resolved parallel layout; raises ConfigError naming the first problem: every check
    the run would make before its first step. device_here=False (a dry run on a machine
    without the run's GPUs) skips the device check and reports the device as configured."""
    world = world_size or launch_world_size()
    cfg.data_parallel_size(world)  # refuses a world the layout does not divide
    accumulation = cfg.accumulation_steps(world)
    device_type = cfg.train.device
    if device_here:
        try:
            device_type = resolve_device(cfg.train.device).type
        except ValueError as err:
            raise ConfigError(f"train.device: {err}") from None
    if cfg.train.deterministic and deterministic_problem(os.environ):
        raise ConfigError(deterministic_problem(os.environ))
    open_initial_weights(cfg)  # headers only: exists, reproducible, same architecture
    from ..tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer(cfg.tokenizer_path())
        fingerprint = tokenizer.fingerprint  # builds the DigitVocab: refuses merged digits
    except TokenizerError as err:
        raise ConfigError(f"data.tokenizer: {err}") from None
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
            f"tokenizer's {tokenizer.vocab_size} tokens ({cfg.data.tokenizer})"
        )
    for section, held_out in (("data.sources", False), ("eval.sources", True)):
        if held_out and not cfg.eval.sources:
            continue
        try:
            load_manifests(cfg.data_config(held_out=held_out), fingerprint, check_shards=True)
        except DataError as err:
            raise ConfigError(f"{section}: {err}") from None
    _writable(Path(cfg.output_dir))
    if cfg.logging.wandb == "online" and not os.environ.get("WANDB_API_KEY"):
        raise ConfigError(
            "logging.wandb=online needs WANDB_API_KEY in the environment (or logging.wandb="
            "offline, synced later with `wandb sync`)"
        )
    resumes_at, changes = _resume_point(cfg, resume, fingerprint, world)
    from .checkpointing import layout as run_layout

    layout = run_layout(cfg, world)  # the one record of a layout (checkpoint/layout.py)
    return {
        "resume_step": resumes_at,
        "resume_changes": changes,
        "world_size": world,
        "tensor_parallel": layout.tensor_parallel,
        "data_parallel": layout.data_parallel,
        "gradient_accumulation": accumulation,
        "zero_stage": layout.zero_stage,  # the deepspeed engine's (None: megatron's)
        "device": device_type,
        "padded_vocab_size": cfg.model.padded_vocab_size(cfg.parallel.tensor_parallel),
        "tokenizer": fingerprint,
        "engine": layout.engine,
        "pipeline_parallel": layout.pipeline_parallel,
        "virtual_pipeline_parallel": layout.virtual_pipeline_parallel,
    }
