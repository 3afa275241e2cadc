"""The trainer's side of checkpoints: what a save or a load of a run is handed (the layout,
this rank's place, the engine's adapter and own state, the scheduler: checkpoint/parts.py),
made from the run here, so that the checkpoint package knows no trainer and no global
parallel state. Every call makes its adapter afresh (an adapter is for one save or load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load as loading
from ..checkpoint import publish as publishing
from ..checkpoint import save as saving
from ..checkpoint.directory import root_of
from ..checkpoint.layout import Layout
from ..checkpoint.parts import Parts, Record
from ..config import RunConfig, dump_run_config
from . import schedule as schedule_file
from .engines import kind_of


def layout(cfg: RunConfig, world: int) -> Layout:
    """The checkpoint layout of a run of `cfg` on `world` ranks (its engine's)."""
    return kind_of(cfg.train.engine).layout(cfg, world)


def parts(run: Any) -> Parts:
    """What a save or a load of `run` (training/trainer.Run) is handed."""
    kind = run.engine_kind
    return Parts(
        layout=kind.layout(run.cfg, run.world),
        place=run.place,
        adapter=kind.checkpoint_adapter(run),
        scheduler=run.scheduler,
        device=run.device,
        vocab_size=run.cfg.model.vocab_size,
        native=kind.native_state(run.engine),
    )


def versions() -> dict[str, str]:
    import deepspeed
    import megatron.core

    from .. import __version__

    return {
        "del_megatron": __version__,
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "deepspeed": deepspeed.__version__,
    }


def record(run: Any, step: int) -> Record:
    """Rank 0's record of step `step`: meta.json's fields past the layout, run_config.yaml
    and the schedule a resume follows (training/schedule.py), the model's record and the
    tokenizer."""
    cfg = run.cfg
    meta = {
        "layout_free": cfg.train.layout_free_checkpoints,
        "tokens": step * cfg.train.global_batch_size * cfg.train.seq_len,
        "tokenizer": run.tokenizer.fingerprint,
        "versions": versions(),
    }
    texts = {"run_config.yaml": dump_run_config(cfg)}
    if run.schedule is not None:
        texts[schedule_file.FILE] = run.schedule.text()
    tokenizer = cfg.tokenizer_path() if run.is_main else None
    return Record(meta=meta, texts=texts, architecture=cfg.model, tokenizer=tokenizer)


def save(run: Any, step: int, loader: Any | None, *, keep: int) -> saving.PendingSave:
    """Start the checkpoint of step `step` (checkpoint/save.py); `publish` completes it."""
    cfg = run.cfg
    handed = parts(run)
    samples = step * cfg.train.global_batch_size
    return saving.save(
        handed,
        root_of(cfg.output_dir),
        step,
        loader,
        record=record(run, step) if run.is_main else Record(architecture=cfg.model),
        counters=handed.adapter.counters(step, samples, run.nonfinite_total),
        keep=keep,
        layout_free=cfg.train.layout_free_checkpoints,
        background=cfg.train.background_checkpoints,
    )


def publish(run: Any, pending: saving.PendingSave, *, run_ends: bool = False) -> Path:
    """The save made a checkpoint, on every rank (checkpoint/publish.py)."""
    return publishing.publish(run.place, pending, run_ends=run_ends)


def architecture(cfg: RunConfig) -> dict[str, Any]:
    """The run's model record as a checkpoint's arch.json is compared with it."""
    return cfg.model.model_dump(mode="json")


def check(path: Path, cfg: RunConfig, fingerprint: str, world: int) -> dict[str, Any]:
    """Whether a run of `cfg` on `world` ranks can resume from `path`, before anything is
    built (checkpoint/load.check); returns its meta.json."""
    return loading.check(path, layout(cfg, world), fingerprint, architecture(cfg), world)


def load(run: Any, path: Path, loader: Any | None) -> int:
    """Restore `run` and its loader from `path` (checkpoint/load.py); returns the step."""
    return loading.load(
        parts(run),
        path,
        loader,
        fingerprint=run.tokenizer.fingerprint,
        architecture=architecture(run.cfg),
        seed=run.cfg.train.seed,
    )
