"""The training thread's half of a save: every collective, and a host copy of what this rank
writes (the layout-free optimizer state through the engine's adapter, the weights, RNG, the
data state, the record); the files are written behind training by checkpoint/writer.py and
made a checkpoint by publish.py.

Everything of a checkpoint is written under `checkpoints/.tmp-step-NNNNNNN/` and the
directory is renamed to `step-NNNNNNN/` by rank 0 once every rank has written and flushed
its files (`publish.publish`): a directory with a final name is always complete, and a
killed save leaves only a `.tmp-` directory that resume ignores (and removes).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import collectives
from ..config import dump_run_config
from ..data import StreamingLoader
from ..data.state import rank_record, saved_file
from ..outputs import free_bytes, is_no_space, no_space
from ..training import schedule as schedule_file
from . import optim_state, writer
from .directory import (
    DATA_STATE,
    PREFIX,
    TMP_PREFIX,
    CheckpointError,
    complete_checkpoints,
    root_of,
)
from .engines import Adapter, adapter_of
from .engines.deepspeed import TAG as NATIVE
from .optim_format import OPTIM
from .rng import rng_state


def _versions() -> dict[str, str]:
    import deepspeed
    import megatron.core

    from .. import __version__

    return {
        "del_megatron": __version__,
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "deepspeed": deepspeed.__version__,
    }


@dataclass
class PendingSave:
    """A checkpoint whose files are being written (checkpoint/writer.py): `publish`
    makes it a checkpoint once every rank's writer has finished."""

    tmp: Path  # .tmp-step-NNNNNNN: what resume ignores
    final: Path
    keep: int
    needed: int  # bytes, for the line of a disk that fills during the write
    writing: writer.Writing
    background: bool  # the same on every rank (the config's): written behind training
    waited_s: float  # what `save` took on the training thread


def save(run: Any, step: int, loader: StreamingLoader | None, *, keep: int) -> PendingSave:
    """Start the checkpoint of step `step` (every rank; the one before it published first):
    this rank's part of the state is copied to host memory and its files are written behind
    training when train.background_checkpoints (else now); `publish` completes it, and keeps
    the newest `keep`. A disk without room for it is one line on every rank
    (CheckpointError: exit status 2), checked before the first byte is written; a disk that
    fills during the write anyway is one line too, at `publish`."""
    started = time.perf_counter()
    root = root_of(run.cfg.output_dir)
    needed = check_space(run, root)
    try:
        return _start(run, step, loader, keep=keep, needed=needed, started=started)
    except Exception as err:  # torch.save and DeepSpeed wrap the OSError in RuntimeError
        if is_no_space(err):
            raise CheckpointError(str(no_space(root, needed))) from None
        raise


def bytes_needed(run: Any, root: Path) -> int:
    """The bytes one more checkpoint takes: the newest complete one's size, else a lower
    bound from the parameter count (weights in the training dtype, and the fp32 master and
    two moments: 12 bytes in the layout-free state, 16 in DeepSpeed's own, which holds the
    fp32 weights once more)."""
    found = complete_checkpoints(root)
    if found:
        return sum(p.stat().st_size for p in found[-1].rglob("*") if p.is_file())
    count, size = adapter_of(run).state_bytes()
    count *= run.cfg.parallel.tensor_parallel
    per = size + (12 if run.cfg.train.layout_free_checkpoints else 16)
    return count * per


def being_freed(root: Path) -> int:
    """Bytes of old checkpoints out of the namespace whose deletion behind training has not
    ended (`publish`): space that is ours to count as free. Their files vanish while this
    counts them (a file already deleted counts 0)."""
    total = 0
    for old in root.glob(TMP_PREFIX + "old-*"):
        for path in old.rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except OSError:  # deleted between the listing and the stat
                pass
    return total


def check_space(run: Any, root: Path) -> int:
    """Refuse a save the disk has no room for, on every rank (rank 0 looks, all agree);
    returns the bytes needed."""
    needed = bytes_needed(run, root)
    refusal = None
    if run.is_main and free_bytes(root) + being_freed(root) < needed:
        refusal = str(no_space(root, needed))
    refusal = collectives.all_gather_object(refusal)[0]
    if refusal:
        raise CheckpointError(refusal)
    return needed


def _start(
    run: Any, step: int, loader: StreamingLoader | None, *, keep: int, needed: int, started: float
) -> PendingSave:
    """The training thread's half of a save: every collective, and a host copy of what this
    rank writes; the files are written by the returned save's writer."""
    root = root_of(run.cfg.output_dir)
    name = f"{PREFIX}{step:07d}"
    tmp, final = root / (TMP_PREFIX + name), root / name
    if run.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    collectives.barrier()
    (tmp / "rng").mkdir(exist_ok=True)
    # one copy of the optimizer state: the layout-free one (read at every layout), or with
    # train.layout_free_checkpoints=false DeepSpeed's own (read at the saved layout only),
    # which DeepSpeed writes now: such a save is not written behind training
    background = run.cfg.train.background_checkpoints
    adapter = adapter_of(run)
    if run.cfg.train.layout_free_checkpoints:
        jobs = [_layout_free_job(run, adapter, tmp, step)]
    else:  # the config allows it with the deepspeed engine only
        from .engines import deepspeed

        jobs, background = [deepspeed.native_save(run.engine, tmp, step)], False
    jobs += [
        _weights_job(run, adapter, tmp),
        _rng_job(run, tmp),
        _data_state_job(run, tmp, loader),
    ]
    if run.is_main:
        jobs.append(_record_job(run, tmp, step))
    directories = [tmp, tmp / OPTIM, tmp / "model", tmp / "rng", tmp / NATIVE]
    writing = writer.start(
        [job for job in jobs if job is not None], directories, background=background
    )
    waited = time.perf_counter() - started
    return PendingSave(tmp, final, keep, needed, writing, background, waited)


def _record_job(run: Any, directory: Path, step: int) -> writer.Job:
    """meta.json, run_config.yaml and the schedule (rank 0), as text now."""
    meta = {
        "step": step,
        "world_size": run.world,
        "data_parallel": run.dp_size,
        "tensor_parallel": run.cfg.parallel.tensor_parallel,
        "pipeline_parallel": run.cfg.parallel.pipeline_parallel,
        "virtual_pipeline_parallel": run.cfg.parallel.virtual_pipeline_parallel,
        "engine": run.cfg.train.engine,
        # ZeRO is the deepspeed engine's (megatron's engine: its distributed optimizer)
        "zero_stage": run.cfg.parallel.zero_stage if run.cfg.train.engine == "deepspeed" else None,
        "layout_free": run.cfg.train.layout_free_checkpoints,
        "tokens": step * run.cfg.train.global_batch_size * run.cfg.train.seq_len,
        "tokenizer": run.tokenizer.fingerprint,
        "versions": _versions(),
    }
    texts = {"run_config.yaml": dump_run_config(run.cfg), "meta.json": json.dumps(meta, indent=1)}
    if run.schedule is not None:  # a resume follows the same function (training/schedule.py)
        texts[schedule_file.FILE] = run.schedule.text()

    def write() -> dict[str, dict[str, Any]]:
        entries = {}
        for relative, text in texts.items():
            (directory / relative).write_text(text)
            entries.update(writer.flushed(directory, relative))
        return entries

    return write


def _rng_job(run: Any, directory: Path) -> writer.Job:
    """rng/rankNNNNN.pt: this rank's generators as they are now."""
    state = rng_state(run.device)
    relative = f"rng/rank{run.rank:05d}.pt"

    def write() -> dict[str, dict[str, Any]]:
        torch.save(state, directory / relative)
        return writer.flushed(directory, relative)

    return write


def _weights_job(run: Any, adapter: Adapter, directory: Path) -> writer.Job | None:
    """model/tpNN.safetensors (tpNN-ppKK.safetensors: stage KK's, at pipeline parallel > 1)
    from data-parallel rank 0 of each tensor-parallel rank (and stage), in the training
    dtype with canonical (local-spec) names, layers by their global number, arch.json and
    the tokenizer: what del-convert megatron-to-hf and init.megatron read, safe to load
    (safetensors, no pickle). The host copy is taken now (under ZeRO 3 a gather every
    data-parallel rank joins)."""
    from megatron.core import parallel_state

    from ..models.weight_files import WEIGHTS, rank_file, write_rank_weights, write_weights_record

    weights = adapter.host_weights(run.dp_rank == 0)
    if run.dp_rank != 0:
        return None
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tokenizer = run.cfg.tokenizer_path() if run.is_main else None

    def write() -> dict[str, dict[str, Any]]:
        out = directory / WEIGHTS
        out.mkdir(exist_ok=True)
        written = [f"{WEIGHTS}/{rank_file(tp_rank, adapter.pp_rank)}"]
        write_rank_weights(out, tp_rank, weights, stage=adapter.pp_rank)
        if run.is_main:
            write_weights_record(out, run.cfg.model, tokenizer)
            written.append(f"{WEIGHTS}/arch.json")
            if tokenizer is not None:
                written.append(f"{WEIGHTS}/{Path(tokenizer).name}")
        entries = {}
        for relative in written:
            entries.update(writer.flushed(directory, relative))
        return entries

    return write


def _layout_free_job(run: Any, adapter: Adapter, directory: Path, step: int) -> writer.Job:
    """optim/: this rank's part of the layout-free state (optim_state.py), copied to the host
    now; the job writes it and returns its files' sizes and checksums."""
    from megatron.core import parallel_state

    counters = adapter.counters(step, step * run.cfg.train.global_batch_size, run.nonfinite_total)
    return optim_state.save_job(
        adapter,
        directory,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=run.cfg.parallel.tensor_parallel,
        dp_rank=run.dp_rank,
        dp_size=run.dp_size,
        pp_size=run.cfg.parallel.pipeline_parallel,
        vocab_size=run.cfg.model.vocab_size,
        extra={
            "zero_stage": run.cfg.parallel.zero_stage,
            "scheduler_last_epoch": int(run.scheduler.last_epoch),
            **counters,
        },
    )


def _data_state_job(run: Any, directory: Path, loader: StreamingLoader | None) -> writer.Job | None:
    """data_state.json (data/state.py's saved_file): the segment with its taken sets once, from
    data-parallel rank 0 (global rank 0, which writes the file), and one record per
    data-parallel rank, gathered to it now from the first tensor-parallel rank of each (its
    peers hold the same state and send nothing): the bytes gathered grow with the
    data-parallel size, not the tensor-parallel one, and no rank but the writer receives
    any. At pipeline parallel > 1 the first stage's ranks send (every stage reads the same
    batches)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    if parallel_state.get_pipeline_model_parallel_rank() != 0:
        return None
    state = loader.state_dict() if loader is not None else None
    records = collectives.gather_object(
        rank_record(state) if state is not None else None, group=run.dp_group
    )
    if not run.is_main:
        return None
    text = json.dumps(saved_file(state, records or []))

    def write() -> dict[str, dict[str, Any]]:
        (directory / DATA_STATE).write_text(text)
        return writer.flushed(directory, DATA_STATE)

    return write
