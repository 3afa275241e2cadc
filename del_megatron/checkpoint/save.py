"""The training thread's half of a save: every collective, and a host copy of what this rank
writes (the layout-free optimizer state through the engine's adapter, the weights, RNG, the
data state, the record; the tensors' copies queued into page-locked memory, host.py, and
waited for once); the files are written behind training by checkpoint/writer.py and made a
checkpoint by publish.py.

Everything of a checkpoint is written under `checkpoints/.tmp-step-NNNNNNN-TOKEN/` (the
job's own name: checkpoint/directory.py) and the directory is renamed to `step-NNNNNNN/` by
rank 0 once every rank has written and flushed its files (`publish.publish`): a directory
with a final name is always complete, and a killed save leaves only a `.tmp-` directory
that resume ignores (and removes).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import collectives, runtime
from ..data.state import rank_record, saved_file
from ..outputs import agreed_fence, free_bytes, is_no_space, no_space
from . import optim_state, writer
from .directory import (
    DATA_STATE,
    PREFIX,
    TMP_PREFIX,
    CheckpointError,
    complete_checkpoints,
    staging_of,
    still_held,
)
from .native import TAG as NATIVE
from .optim_format import OPTIM
from .parts import Parts, Record
from .rng import rng_state


@dataclass
class PendingSave:
    """A checkpoint whose files are being written (checkpoint/writer.py): `publish`
    makes it a checkpoint once every rank's writer has finished."""

    tmp: Path  # .tmp-step-NNNNNNN-TOKEN: what resume ignores
    final: Path
    keep: int
    needed: int  # bytes, for the line of a disk that fills during the write
    writing: writer.Writing
    background: bool  # the same on every rank (the config's): written behind training
    waited_s: float  # what `save` took on the training thread


def save(
    parts: Parts,
    root: Path,
    step: int,
    loader: Any | None,
    *,
    record: Record,
    counters: dict[str, int],
    keep: int,
    layout_free: bool = True,
    background: bool = True,
) -> PendingSave:
    """Start the checkpoint of step `step` under `root` (checkpoints/; every rank, the one
    before it published first): this rank's part of the state is copied to host memory and
    its files are written behind training when `background` (else now); `publish` completes
    it, and keeps the newest `keep`. loader: the data loader whose `state_dict()` is saved
    (None: no data state); counters: the engine's counters for the optimizer index
    (`Adapter.counters`); layout_free: the layout-free optimizer state, else the engine's own
    (`parts.native`, written now). A disk without room for it is one line on every rank
    (CheckpointError: exit status 2), checked before the first byte is written; a disk that
    fills during the write anyway is one line too, at `publish`."""
    started = time.perf_counter()
    needed = check_space(parts, root, layout_free)
    # the job's own staging name, from its lock (asked: a job that lost it stops here)
    token = agreed_fence(root.parent, leader=parts.place.is_main)
    tmp, final = staging_of(root, step, token), root / f"{PREFIX}{step:07d}"
    try:
        directories, jobs, background = _jobs(
            parts, tmp, step, loader, record, counters, layout_free, background
        )
        # the host copies `_jobs` queued (host.host_copies), waited for once: before the
        # writer reads them, and before the next step changes what they copy
        runtime.synchronize(parts.device)
        writing = writer.start(jobs, directories, background=background)
    except Exception as err:  # torch.save and DeepSpeed wrap the OSError in RuntimeError
        if is_no_space(err):
            raise CheckpointError(str(no_space(root, needed))) from None
        raise
    waited = time.perf_counter() - started
    return PendingSave(tmp, final, keep, needed, writing, background, waited)


def bytes_needed(parts: Parts, root: Path, layout_free: bool) -> int:
    """The bytes one more checkpoint takes: the newest complete one's size, else a lower
    bound from the parameter count (weights in the training dtype, and the fp32 master and
    two moments: 12 bytes in the layout-free state, 16 in DeepSpeed's own, which holds the
    fp32 weights once more)."""
    found = complete_checkpoints(root)
    if found:
        return sum(p.stat().st_size for p in found[-1].rglob("*") if p.is_file())
    count, size = parts.adapter.state_bytes()
    count *= parts.layout.tensor_parallel
    per = size + (12 if layout_free else 16)
    return count * per


def being_freed(root: Path) -> int:
    """Bytes of old checkpoints out of the namespace whose deletion behind training has not
    ended (`publish`): space that is ours to count as free. Their files vanish while this
    counts them (a file already deleted counts 0)."""
    total = 0
    for old in root.glob(TMP_PREFIX + "old-*"):
        # os.walk skips a directory deleted before it is listed (Path.rglob raised
        # FileNotFoundError there: a save beside the deletion failed)
        for directory, _, names in os.walk(old):
            for name in names:
                try:
                    total += os.stat(os.path.join(directory, name)).st_size
                except OSError:  # deleted between the listing and the stat
                    pass
    return total


def check_space(parts: Parts, root: Path, layout_free: bool) -> int:
    """Refuse a save the disk has no room for, on every rank: rank 0 alone looks (the newest
    checkpoint's files walked once, not on every rank), all agree; returns the bytes needed,
    rank 0's figure on every rank."""
    answer = None
    if parts.place.is_main:
        needed = bytes_needed(parts, root, layout_free)
        short = free_bytes(root) + being_freed(root) < needed
        answer = (needed, str(no_space(root, needed)) if short else None)
    needed, refusal = collectives.all_gather_object(answer)[0]
    if refusal:
        raise CheckpointError(refusal)
    return needed


def _jobs(
    parts: Parts,
    tmp: Path,
    step: int,
    loader: Any | None,
    record: Record,
    counters: dict[str, int],
    layout_free: bool,
    background: bool,
) -> tuple[list[Path], list[writer.Job], bool]:
    """The training thread's half of a save: every collective, and a host copy of what this
    rank writes, as the writer's jobs, under the staging directory `tmp`: (the directories
    they write; the jobs; whether they are written behind training)."""
    if parts.place.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()  # never `parents`: a staging moved away by a new holder stays away
    still_held(tmp, leader=parts.place.is_main)  # made, then asked again; also the barrier
    (tmp / "rng").mkdir(exist_ok=True)
    # one copy of the optimizer state: the layout-free one (read at every layout), or the
    # engine's own (read at the saved layout only), which the engine writes now: such a save
    # is not written behind training
    if layout_free:
        jobs = [_layout_free_job(parts, tmp, counters)]
    else:  # the config allows it with an engine that has a state of its own only
        jobs, background = [parts.native.save_job(tmp, step)], False
    jobs += [
        _weights_job(parts, tmp, record),
        _rng_job(parts, tmp),
        _data_state_job(parts, tmp, loader),
    ]
    if parts.place.is_main:
        jobs.append(_record_job(parts, tmp, step, record))
    directories = [tmp, tmp / OPTIM, tmp / "model", tmp / "rng", tmp / NATIVE]
    return directories, [job for job in jobs if job is not None], background


def _record_job(parts: Parts, directory: Path, step: int, record: Record) -> writer.Job:
    """meta.json and the record's text files (rank 0), as text now."""
    meta = {"step": step, "world_size": parts.place.world, **parts.layout.meta(), **record.meta}
    texts = {**record.texts, "meta.json": json.dumps(meta, indent=1)}

    def write() -> dict[str, dict[str, Any]]:
        entries = {}
        for relative, text in texts.items():
            (directory / relative).write_text(text)
            entries.update(writer.flushed(directory, relative))
        return entries

    return write


def _rng_job(parts: Parts, directory: Path) -> writer.Job:
    """rng/rankNNNNN.pt: this rank's generators as they are now."""
    state = rng_state(parts.device)
    relative = f"rng/rank{parts.place.rank:05d}.pt"

    def write() -> dict[str, dict[str, Any]]:
        torch.save(state, directory / relative)
        return writer.flushed(directory, relative)

    return write


def _weights_job(parts: Parts, directory: Path, record: Record) -> writer.Job | None:
    """model/tpNN.safetensors (tpNN-ppKK.safetensors: stage KK's, at pipeline parallel > 1)
    from data-parallel rank 0 of each tensor-parallel rank (and stage), in the training
    dtype with canonical (local-spec) names, layers by their global number, arch.json and
    the tokenizer: what del-convert megatron-to-hf and init.megatron read, safe to load
    (safetensors, no pickle). The host copy is queued now (`Adapter.host_weights`, through
    host.host_copies; under ZeRO 3 a gather every data-parallel rank joins) and waited for
    by `save`."""
    from ..models.weight_files import WEIGHTS, rank_file, write_rank_weights, write_weights_record

    place, adapter = parts.place, parts.adapter
    weights = adapter.host_weights(place.writes_weights)
    if not place.writes_weights:
        return None
    tokenizer = record.tokenizer if place.is_main else None

    def write() -> dict[str, dict[str, Any]]:
        out = directory / WEIGHTS
        out.mkdir(exist_ok=True)
        written = [f"{WEIGHTS}/{rank_file(place.tp_rank, adapter.pp_rank)}"]
        write_rank_weights(out, place.tp_rank, weights, stage=adapter.pp_rank)
        if place.is_main:
            write_weights_record(out, record.architecture, tokenizer)
            written.append(f"{WEIGHTS}/arch.json")
            if tokenizer is not None:
                written.append(f"{WEIGHTS}/{Path(tokenizer).name}")
        entries = {}
        for relative in written:
            entries.update(writer.flushed(directory, relative))
        return entries

    return write


def _layout_free_job(parts: Parts, directory: Path, counters: dict[str, int]) -> writer.Job:
    """optim/: this rank's part of the layout-free state (optim_state.py), copied to the host
    now; the job writes it and returns its files' sizes and checksums."""
    layout, place = parts.layout, parts.place
    return optim_state.save_job(
        parts.adapter,
        directory,
        tp_rank=place.tp_rank,
        tp_size=layout.tensor_parallel,
        dp_rank=place.dp_rank,
        dp_size=layout.data_parallel,
        pp_size=layout.pipeline_parallel,
        vocab_size=parts.vocab_size,
        extra={
            "zero_stage": layout.zero_stage,
            "scheduler_last_epoch": int(parts.scheduler.last_epoch),
            **counters,
        },
    )


def _data_state_job(parts: Parts, directory: Path, loader: Any | None) -> writer.Job | None:
    """data_state.json (data/state.py's saved_file): the segment with its taken sets once, from
    data-parallel rank 0 (global rank 0, which writes the file), and one record per
    data-parallel rank, gathered to it now from the first tensor-parallel rank of each (its
    peers hold the same state and send nothing): the bytes gathered grow with the
    data-parallel size, not the tensor-parallel one, and no rank but the writer receives
    any. At pipeline parallel > 1 the first stage's ranks send (every stage reads the same
    batches)."""
    place = parts.place
    if not place.writes_data_state:
        return None
    state = loader.state_dict() if loader is not None else None
    records = collectives.gather_object(
        rank_record(state) if state is not None else None, group=place.dp_group
    )
    if not place.is_main:
        return None
    text = json.dumps(saved_file(state, records or []))

    def write() -> dict[str, dict[str, Any]]:
        (directory / DATA_STATE).write_text(text)
        return writer.flushed(directory, DATA_STATE)

    return write
