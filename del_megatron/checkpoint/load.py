"""A resume: which state a checkpoint is read from at this run's layout (the layout rules),
the checks made before anything loads (`check`, shared with `--dry-run` and `--check`), the
contents verified, then the load itself: the model's and optimizer's state through the
engine's adapter (the layout-free state) or DeepSpeed's own, the schedule, the RNG and the
loader's position.

A layout is (engine, tensor parallel, pipeline parallel, virtual stages, data parallel, ZeRO
stage). The layout-free state serves every layout; DeepSpeed's own state (written before the
layout-free state was the one copy, or with train.layout_free_checkpoints=false) only its
own, and the deepspeed engine alone.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from .. import collectives
from ..data import StreamingLoader
from ..errors import one_line
from . import files, optim_format, optim_state
from .directory import DATA_STATE, CheckpointError, data_state
from .engines import adapter_of
from .engines import deepspeed as deepspeed_engine
from .rng import derived_seed, seed_rng, set_rng_state


def saved_layout(meta: dict[str, Any]) -> dict[str, Any]:
    """The parallel layout a checkpoint was saved at (zero_stage None: saved before it was
    recorded, or by the megatron engine; no engine or pipeline recorded: the deepspeed
    engine's single stage, all there was)."""
    return {
        "engine": meta.get("engine", "deepspeed"),
        "tensor_parallel": meta.get("tensor_parallel"),
        "pipeline_parallel": meta.get("pipeline_parallel", 1),
        "virtual_pipeline_parallel": meta.get("virtual_pipeline_parallel"),
        "data_parallel": meta.get("data_parallel"),
        "zero_stage": meta.get("zero_stage"),
    }


def run_layout(cfg: Any, world: int) -> dict[str, Any]:
    deepspeed = cfg.train.engine == "deepspeed"
    return {
        "engine": cfg.train.engine,
        "tensor_parallel": cfg.parallel.tensor_parallel,
        "pipeline_parallel": cfg.parallel.pipeline_parallel,
        "virtual_pipeline_parallel": cfg.parallel.virtual_pipeline_parallel,
        "data_parallel": cfg.data_parallel_size(world),
        "zero_stage": cfg.parallel.zero_stage if deepspeed else None,
    }


def changed(saved: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether `wanted` is another layout than the saved one, which DeepSpeed's per-rank
    state cannot serve (an unrecorded ZeRO stage is taken as unchanged: DeepSpeed itself then
    says whether its state loads)."""
    return any(
        saved[key] != wanted[key] for key in wanted if saved[key] is not None or key != "zero_stage"
    )


def same_positions(saved: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether every rank has the same place in the model as when saved (its generators'
    states then are its own): the same tensor, pipeline and data-parallel sizes."""
    keys = ("tensor_parallel", "pipeline_parallel", "virtual_pipeline_parallel", "data_parallel")
    return all(saved[k] == wanted[k] for k in keys)


def describe(layout: dict[str, Any]) -> str:
    zero = "" if layout["zero_stage"] is None else f", ZeRO {layout['zero_stage']}"
    stages = ""
    if layout.get("pipeline_parallel", 1) > 1:
        stages = f" x pipeline parallel {layout['pipeline_parallel']}"
        if layout.get("virtual_pipeline_parallel"):
            stages += f" ({layout['virtual_pipeline_parallel']} virtual)"
    engine = "" if layout.get("engine", "deepspeed") == "deepspeed" else " (megatron engine)"
    return (
        f"tensor parallel {layout['tensor_parallel']}{stages} x data parallel "
        f"{layout['data_parallel']}{zero}{engine}"
    )


def how_to_run(layout: dict[str, Any], world: Any, engine: str) -> str:
    """The overrides of the saved `layout` for a run now on `engine` (named when it differs:
    DeepSpeed's own state is the deepspeed engine's)."""
    zero = "" if layout["zero_stage"] is None else f" parallel.zero_stage={layout['zero_stage']}"
    other = "" if layout["engine"] == engine else f"train.engine={layout['engine']} "
    return f"{other}parallel.tensor_parallel={layout['tensor_parallel']}{zero} on {world} processes"


def has_deepspeed_state(path: Path) -> bool:
    """Whether the checkpoint holds DeepSpeed's own state (written before the layout-free
    state became the one copy, or with train.layout_free_checkpoints=false)."""
    return (path / deepspeed_engine.TAG).is_dir()


def reads_layout_free(path: Path, saved: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a resume at `wanted` reads the layout-free state: at another layout, and at
    the saved one when it is the checkpoint's only optimizer state (DeepSpeed's, where
    written, is read at its own layout: the checkpoints written before the layout-free state
    was the one copy, or with train.layout_free_checkpoints=false)."""
    if changed(saved, wanted):
        return True
    return optim_format.has_state(path) and not has_deepspeed_state(path)


def check(path: Path, cfg: Any, fingerprint: str, world: int) -> dict[str, Any]:
    """A checkpoint this run can resume from, before anything is loaded (preflight runs it
    too): its metadata, tokenizer, layout (another one needs the layout-free state) and
    architecture, and the files DeepSpeed does not check. Returns meta.json;
    CheckpointError names the first problem."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}/meta.json: unreadable ({one_line(err)})") from None
    if meta.get("tokenizer") != fingerprint:
        raise CheckpointError(f"{path}: saved with another tokenizer than data.tokenizer")
    saved, wanted = saved_layout(meta), run_layout(cfg, world)
    if changed(saved, wanted):
        if not optim_format.has_state(path):
            raise CheckpointError(
                f"{path}: saved at {describe(saved)} without the layout-free state (optim/), "
                f"this run is at {describe(wanted)}: resume at the saved layout "
                f"({how_to_run(saved, meta.get('world_size'), wanted['engine'])})"
            )
        try:
            optim_format.read_index(path)
        except optim_format.LayoutFreeError as err:
            raise CheckpointError(str(err)) from None
    arch_path = path / "model" / "arch.json"
    try:
        saved = json.loads(arch_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{arch_path}: unreadable ({one_line(err)})") from None
    for name, value in cfg.model.model_dump(mode="json").items():
        if name in saved and saved[name] != value:
            raise CheckpointError(
                f"{path}: saved with model.{name}={saved[name]}, this run has {value} "
                "(another architecture)"
            )
    loader_state = data_state(path)
    saved_dp = loader_state.first.dp_size if loader_state is not None else None
    if saved_dp is not None and meta.get("data_parallel", saved_dp) != saved_dp:
        raise CheckpointError(
            f"{path}/{DATA_STATE}: saved at data-parallel size {saved_dp}, meta.json says "
            f"{meta['data_parallel']}: the files are of two checkpoints; resume from another"
        )
    if meta.get("world_size") == world:
        for rank in range(world):
            rng = path / "rng" / f"rank{rank:05d}.pt"
            if not rng.is_file():
                raise CheckpointError(f"{rng}: missing")
    check_load_files(path, meta, reads_layout_free(path, saved_layout(meta), wanted))
    meta["step"] = step
    return meta


def check_load_files(path: Path, meta: dict[str, Any], layout_free_state: bool) -> None:
    """Every file the load will read, by size and header (files.py): the layout-free
    state's, or DeepSpeed's (`reads_layout_free`)."""
    try:
        if layout_free_state:
            needed = optim_format.layout_free_files(optim_format.read_index(path))
        else:
            needed = deepspeed_engine.native_files(meta)
        files.check_files(path, needed)
    except (files.ChecksumError, optim_format.LayoutFreeError) as err:
        raise CheckpointError(str(err)) from None


def verify_contents(run: Any, path: Path) -> None:
    """The checkpoint's files against their checksums, each rank hashing its share; the
    outcome agreed, so a corrupted file is refused on every rank."""
    found = files.verify_share(path, run.rank, run.world)
    problems = [p for p in collectives.all_gather_object(found) if p]
    if problems:
        raise CheckpointError(problems[0])


def load(run: Any, path: Path, loader: StreamingLoader | None) -> int:
    """Restore model, optimizer, scheduler, RNG and this rank's loader; returns the step."""
    meta = check(path, run.cfg, run.tokenizer.fingerprint, run.world)
    verify_contents(run, path)
    saved, wanted = saved_layout(meta), run_layout(run.cfg, run.world)
    if reads_layout_free(path, saved, wanted):
        _load_layout_free(run, path)
    else:
        deepspeed_engine.native_load(run.engine, path)
    if changed(saved, wanted):
        if run.is_main:
            print(
                f"resuming at {describe(wanted)} (saved at {describe(saved)}): fp32 weights, "
                "Adam moments and steps and the schedule restored from the layout-free state",
                flush=True,
            )
    if not same_positions(saved, wanted):
        seed_rng(derived_seed(run.cfg.train.seed, int(meta["step"]), run.dp_rank), run.device)
    elif meta.get("world_size") == run.world:
        rng_path = path / "rng" / f"rank{run.rank:05d}.pt"
        try:
            # RNG states are host byte tensors whatever the device (map_location: a state
            # file never lands on a GPU the loading rank may not have)
            rng = torch.load(rng_path, weights_only=True, map_location="cpu")
            set_rng_state(rng, run.device)
        except (OSError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError) as err:
            raise CheckpointError(f"{rng_path}: unreadable ({one_line(err)[:200]})") from None
    if loader is not None:
        message = loader.resume(data_state(path))  # any layout and mix: what changed, a line
        if message and run.is_main:
            print(message, flush=True)
    return int(meta["step"])


def _load_layout_free(run: Any, path: Path) -> None:
    """Masters, moments and steps from optim/ (at any layout, the saved one included) through
    the engine's adapter, the model's weights from the masters, the schedule and the
    engine's counters from the index."""
    from megatron.core import parallel_state

    adapter = adapter_of(run)
    index = optim_state.load(
        adapter,
        path,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=run.cfg.parallel.tensor_parallel,
        vocab_size=run.cfg.model.vocab_size,
    )
    # the schedule's position, set rather than stepped to: LambdaLR's rate is a function of
    # it alone, and non-finite steps (which skip the schedule) are counted in it; through
    # the scheduler's own state dict, then one step to recompute the rates
    schedule = run.scheduler.state_dict()
    schedule["last_epoch"] = int(index["scheduler_last_epoch"]) - 1
    run.scheduler.load_state_dict(schedule)
    run.scheduler.step()
    adapter.set_counters(index)
