"""A resume: which state a checkpoint is read from at this run's layout (the layout rules),
the checks made before anything loads (`check`, shared with `--dry-run` and `--check`), the
contents verified, then the load itself: the model's and optimizer's state through the
engine's adapter (the layout-free state) or DeepSpeed's own, the schedule, the RNG and the
loader's position.

A layout is layout.Layout (engine, tensor parallel, pipeline parallel, virtual stages, data
parallel, ZeRO stage). The layout-free state serves every layout; an engine's own state
(DeepSpeed's, written before the layout-free state was the one copy, or with
train.layout_free_checkpoints=false) only its own, and that engine alone.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from .. import collectives
from ..errors import one_line
from . import files, optim_format, optim_state
from .directory import DATA_STATE, CheckpointError, data_state
from .layout import Layout, Place
from .native import has_native_state, native_files
from .parts import Parts
from .rng import derived_seed, seed_rng, set_rng_state


def reads_layout_free(path: Path, saved: Layout, wanted: Layout) -> bool:
    """Whether a resume at `wanted` reads the layout-free state: at another layout, and at
    the saved one when it is the checkpoint's only optimizer state (DeepSpeed's, where
    written, is read at its own layout: the checkpoints written before the layout-free state
    was the one copy, or with train.layout_free_checkpoints=false)."""
    if wanted.differs_from(saved):
        return True
    return optim_format.has_state(path) and not has_native_state(path)


def check(
    path: Path, wanted: Layout, fingerprint: str, architecture: dict[str, Any], world: int
) -> dict[str, Any]:
    """A checkpoint a run at layout `wanted` on `world` ranks can resume from, before
    anything is loaded (the start-up checks run it too): its metadata, tokenizer
    (`fingerprint`), layout (another one needs the layout-free state) and architecture (the
    run's model record as JSON), and the files DeepSpeed does not check. Returns meta.json;
    CheckpointError names the first problem."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}/meta.json: unreadable ({one_line(err)})") from None
    if meta.get("tokenizer") != fingerprint:
        raise CheckpointError(f"{path}: saved with another tokenizer than data.tokenizer")
    saved = Layout.saved(meta)
    if wanted.differs_from(saved):
        if not optim_format.has_state(path):
            raise CheckpointError(
                f"{path}: saved at {saved.describe()} without the layout-free state (optim/), "
                f"this run is at {wanted.describe()}: resume at the saved layout "
                f"({saved.how_to_run(meta.get('world_size'), wanted.engine)})"
            )
        try:
            optim_format.read_index(path)
        except optim_format.LayoutFreeError as err:
            raise CheckpointError(str(err)) from None
    arch_path = path / "model" / "arch.json"
    try:
        saved_arch = json.loads(arch_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{arch_path}: unreadable ({one_line(err)})") from None
    for name, value in architecture.items():
        if name in saved_arch and saved_arch[name] != value:
            raise CheckpointError(
                f"{path}: saved with model.{name}={saved_arch[name]}, this run has {value} "
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
    check_load_files(path, meta, reads_layout_free(path, saved, wanted))
    meta["step"] = step
    return meta


def check_load_files(path: Path, meta: dict[str, Any], layout_free_state: bool) -> None:
    """Every file the load will read, by size and header (files.py): the layout-free
    state's, or DeepSpeed's (`reads_layout_free`)."""
    try:
        if layout_free_state:
            needed = optim_format.layout_free_files(optim_format.read_index(path))
        else:
            needed = native_files(meta)
        files.check_files(path, needed)
    except (files.ChecksumError, optim_format.LayoutFreeError) as err:
        raise CheckpointError(str(err)) from None


def verify_contents(place: Place, path: Path) -> None:
    """The checkpoint's files against their checksums, each rank hashing its share; the
    outcome agreed, so a corrupted file is refused on every rank."""
    found = files.verify_share(path, place.rank, place.world)
    problems = [p for p in collectives.all_gather_object(found) if p]
    if problems:
        raise CheckpointError(problems[0])


def load(
    parts: Parts,
    path: Path,
    loader: Any | None,
    *,
    fingerprint: str,
    architecture: dict[str, Any],
    seed: int,
) -> int:
    """Restore model, optimizer, scheduler, RNG and this rank's loader (its `resume`; None:
    no data); returns the step. fingerprint and architecture: as `check` takes them; seed:
    the run's, from which a rank at another place than any saved one draws
    (`rng.derived_seed`)."""
    place, wanted = parts.place, parts.layout
    meta = check(path, wanted, fingerprint, architecture, place.world)
    verify_contents(place, path)
    saved = Layout.saved(meta)
    if reads_layout_free(path, saved, wanted):
        _load_layout_free(parts, path)
    else:
        parts.native.load(path)
    if wanted.differs_from(saved):
        if place.is_main:
            print(
                f"resuming at {wanted.describe()} (saved at {saved.describe()}): fp32 weights, "
                "Adam moments and steps and the schedule restored from the layout-free state",
                flush=True,
            )
    if not wanted.same_positions(saved):
        seed_rng(derived_seed(seed, int(meta["step"]), place.dp_rank), parts.device)
    elif meta.get("world_size") == place.world:
        rng_path = path / "rng" / f"rank{place.rank:05d}.pt"
        try:
            # RNG states are host byte tensors whatever the device (map_location: a state
            # file never lands on a GPU the loading rank may not have)
            rng = torch.load(rng_path, weights_only=True, map_location="cpu")
            set_rng_state(rng, parts.device)
        except (OSError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError) as err:
            raise CheckpointError(f"{rng_path}: unreadable ({one_line(err)[:200]})") from None
    if loader is not None:
        message = loader.resume(data_state(path))  # any layout and mix: what changed, a line
        if message and place.is_main:
            print(message, flush=True)
    return int(meta["step"])


def _load_layout_free(parts: Parts, path: Path) -> None:
    """Masters, moments and steps from optim/ (at any layout, the saved one included) through
    the engine's adapter, the model's weights from the masters, the schedule and the
    engine's counters from the index."""
    index = optim_state.load(
        parts.adapter,
        path,
        tp_rank=parts.place.tp_rank,
        tp_size=parts.layout.tensor_parallel,
        vocab_size=parts.vocab_size,
    )
    # the schedule's position, set rather than stepped to: LambdaLR's rate is a function of
    # it alone, and non-finite steps (which skip the schedule) are counted in it; through
    # the scheduler's own state dict, then one step to recompute the rates
    scheduler = parts.scheduler
    schedule = scheduler.state_dict()
    schedule["last_epoch"] = int(index["scheduler_last_epoch"]) - 1
    scheduler.load_state_dict(schedule)
    scheduler.step()
    parts.adapter.set_counters(index)
