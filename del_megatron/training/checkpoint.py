"""Checkpoints that a crash cannot corrupt, and exact resume (layout: docs/checkpoints.md).

Everything of a checkpoint is written under `checkpoints/.tmp-step-NNNNNNN/` and the
directory is renamed to `step-NNNNNNN/` by rank 0 once every rank has written and flushed
its files (`publish`): a directory with a final name is always complete, and a killed save
leaves only a `.tmp-` directory that resume ignores (and removes). The files are written
behind training (training/checkpoint_writer.py): the step waits for the collectives and the
copy of this rank's part to host memory only.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import collectives, inputs
from ..config import ConfigError, dump_run_config
from ..data import DataError, StreamingLoader
from ..data.state import SavedState, rank_record, read_saved, saved_file
from ..errors import UserError, one_line
from ..outputs import free_bytes, is_no_space, no_space
from . import checkpoint_files, checkpoint_writer, layout_free
from . import schedule as schedule_file

PREFIX = "step-"
TMP_PREFIX = inputs.BEING_WRITTEN  # what readers refuse (del_megatron/inputs.py)
DEEPSPEED_TAG = checkpoint_files.DEEPSPEED_TAG  # the directory of DeepSpeed's own files


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the directory."""


def root_of(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


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
    """A checkpoint whose files are being written (training/checkpoint_writer.py): `publish`
    makes it a checkpoint once every rank's writer has finished."""

    tmp: Path  # .tmp-step-NNNNNNN: what resume ignores
    final: Path
    keep: int
    needed: int  # bytes, for the line of a disk that fills during the write
    writing: checkpoint_writer.Writing
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
    params = [p for p in run.engine.module.parameters() if p.requires_grad]
    count = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    count *= run.cfg.parallel.tensor_parallel
    per = params[0].element_size() + (12 if run.cfg.train.layout_free_checkpoints else 16)
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
    if run.cfg.train.layout_free_checkpoints:
        jobs = [_layout_free_job(run, tmp)]
    else:
        run.engine.save_checkpoint(
            str(tmp), tag=DEEPSPEED_TAG, client_state={"step": step}, save_latest=False
        )
        jobs, background = [_deepspeed_flush_job(tmp)], False
    jobs += [_weights_job(run, tmp), _rng_job(run, tmp), _data_state_job(run, tmp, loader)]
    if run.is_main:
        jobs.append(_record_job(run, tmp, step))
    directories = [tmp, tmp / layout_free.OPTIM, tmp / "model", tmp / "rng", tmp / DEEPSPEED_TAG]
    writing = checkpoint_writer.start(
        [job for job in jobs if job is not None], directories, background=background
    )
    waited = time.perf_counter() - started
    return PendingSave(tmp, final, keep, needed, writing, background, waited)


def publish(run: Any, pending: PendingSave, *, run_ends: bool = False) -> Path:
    """Wait for this rank's writer, agree that every rank's files are written, then write
    files.json and rename `.tmp-step-N` to `step-N` (rank 0), both flushed to the disk, and
    drop the checkpoints beyond the newest `keep` (deleted behind training unless
    `run_ends` after it, or the save was not written in the background). Every rank calls
    it at the same step (the loop does when the step's agreement says no rank is still
    writing). A failed write, files.json or rename is one line on every rank (the rank whose
    write failed with a bug of ours raises it)."""
    entries, failure, problem = {}, None, None
    try:
        entries = pending.writing.result()
    except BaseException as err:  # agreed below before anything raises: no rank hangs
        failure, problem = err, _write_problem(err, pending)
    problems = [p for p in collectives.all_gather_object(problem) if p]
    if problems:
        if failure is not None and not _is_io_failure(failure):
            raise failure
        raise CheckpointError(problems[0])
    try:  # its gathers come first, then rank 0 writes files.json: a full disk meets that
        checkpoint_files.write_index(pending.tmp, entries, run.rank, run.world)
        if run.is_main:
            _rename_and_prune(pending, background=pending.background and not run_ends)
    except Exception as err:
        if not _is_io_failure(err):
            raise
        problem = _write_problem(err, pending)
    problems = [p for p in collectives.all_gather_object(problem) if p]  # also a barrier
    if problems:
        raise CheckpointError(problems[0])
    return pending.final


def _rename_and_prune(pending: PendingSave, *, background: bool) -> None:
    """Rank 0's part of `publish`: files.json and the directory on the disk, the rename
    (flushed: then the checkpoint counts), the old checkpoints out of the namespace, then
    deleted (`background`: behind training). A directory is only ever deleted once out of
    the final namespace: a kill mid-delete leaves a .tmp- directory (the next start removes
    it), never a half-deleted step-N."""
    root = pending.final.parent
    checkpoint_writer.fsync(pending.tmp / checkpoint_files.INDEX)
    checkpoint_writer.sync_directory(pending.tmp)
    doomed = []
    if pending.final.exists():  # the same step saved again (a resume from an older one)
        doomed.append(root / (TMP_PREFIX + "old-" + pending.final.name))
        os.replace(pending.final, doomed[-1])
    os.replace(pending.tmp, pending.final)
    checkpoint_writer.sync_directory(root)
    older = [p for p in complete_checkpoints(root) if p != pending.final]
    for old in older[: len(older) - (pending.keep - 1)] if pending.keep else []:
        doomed.append(root / (TMP_PREFIX + "old-" + old.name))
        os.replace(old, doomed[-1])
    checkpoint_writer.remove(doomed, background=background)


def _is_io_failure(err: BaseException) -> bool:
    """A write that failed for the disk or its permissions (the user's to fix), however a
    library wrapped it: an OSError in the chain, torch.save's and safetensors' own errors."""
    while err is not None:
        if isinstance(err, OSError) or is_no_space(err):
            return True
        text = str(err)
        if type(err).__name__ == "SafetensorError" or "cannot be opened" in text:
            return True
        if any(sign in text for sign in TORCH_WRITE_FAILURES):
            return True
        err = err.__cause__ or err.__context__
    return False


# What torch.save's C++ writer raises (a RuntimeError, its errno lost) when a write fails:
# on a full disk, one of these, depending on where in the file it was
TORCH_WRITE_FAILURES = (
    "PytorchStreamWriter failed",
    "basic_ios::clear: iostream error",
    "unexpected pos",
)


def _write_problem(err: BaseException, pending: PendingSave) -> str:
    """The one line of a failed write: a full disk's (said by the error, or, where a
    library lost the errno, by the disk having less room than the checkpoint needs), else
    the error's."""
    root = pending.final.parent
    if is_no_space(err) or free_bytes(root) + being_freed(root) < pending.needed:
        return str(no_space(root, pending.needed))
    return f"{pending.tmp}: writing the checkpoint failed ({one_line(str(err))[:300]})"


def _deepspeed_flush_job(directory: Path) -> checkpoint_writer.Job:
    """DeepSpeed's files (train.layout_free_checkpoints=false) flushed to the disk before the
    rename; hashed at the publish (`write_index`), shared over the ranks."""

    def flush() -> dict[str, dict[str, Any]]:
        for path in (directory / DEEPSPEED_TAG).rglob("*"):
            if path.is_file():
                checkpoint_writer.fsync(path)
        return {}

    return flush


def _record_job(run: Any, directory: Path, step: int) -> checkpoint_writer.Job:
    """meta.json, run_config.yaml and the schedule (rank 0), as text now."""
    meta = {
        "step": step,
        "world_size": run.world,
        "data_parallel": run.dp_size,
        "tensor_parallel": run.cfg.parallel.tensor_parallel,
        "zero_stage": run.cfg.parallel.zero_stage,
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
            entries.update(checkpoint_writer.flushed(directory, relative))
        return entries

    return write


def _rng_job(run: Any, directory: Path) -> checkpoint_writer.Job:
    """rng/rankNNNNN.pt: this rank's generators as they are now."""
    state = rng_state(run.device)
    relative = f"rng/rank{run.rank:05d}.pt"

    def write() -> dict[str, dict[str, Any]]:
        torch.save(state, directory / relative)
        return checkpoint_writer.flushed(directory, relative)

    return write


def _weights_job(run: Any, directory: Path) -> checkpoint_writer.Job | None:
    """model/tpNN.safetensors from data-parallel rank 0 of each tensor-parallel rank, in the
    training dtype with canonical (local-spec) names, arch.json and the tokenizer: what
    del-convert megatron-to-hf and init.megatron read, safe to load (safetensors, no pickle).
    The host copy is taken now (under ZeRO 3 a gather every data-parallel rank joins)."""
    from megatron.core import parallel_state

    from ..models.weight_files import WEIGHTS, write_rank_weights, write_weights_record

    weights = host_weights(run.engine.module, run.cfg.parallel.zero_stage == 3, run.dp_rank == 0)
    if run.dp_rank != 0:
        return None
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tokenizer = run.cfg.tokenizer_path() if run.is_main else None

    def write() -> dict[str, dict[str, Any]]:
        out = directory / WEIGHTS
        out.mkdir(exist_ok=True)
        written = [f"{WEIGHTS}/tp{tp_rank:02d}.safetensors"]
        write_rank_weights(out, tp_rank, weights)
        if run.is_main:
            write_weights_record(out, run.cfg.model, tokenizer)
            written.append(f"{WEIGHTS}/arch.json")
            if tokenizer is not None:
                written.append(f"{WEIGHTS}/{Path(tokenizer).name}")
        entries = {}
        for relative in written:
            entries.update(checkpoint_writer.flushed(directory, relative))
        return entries

    return write


def host_weights(module: torch.nn.Module, zero3: bool, keep: bool) -> dict[str, torch.Tensor]:
    """{name: host copy} of this rank's parameters when `keep` (else {}). Under ZeRO 3 every
    data-parallel rank takes part in gathering each parameter (a collective), one parameter
    at a time: a device holds its shard of the model plus one whole parameter, never the
    whole model."""
    import deepspeed

    weights = {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=zero3):
            if keep:  # a copy: the next step changes the parameter (on CPU, in place)
                weights[name] = param.detach().to("cpu", copy=True)
    return weights


def _layout_free_job(run: Any, directory: Path) -> checkpoint_writer.Job:
    """optim/: this rank's part of the layout-free state (training/layout_free.py), copied to
    the host now; the job writes it and returns its files' sizes and checksums."""
    from megatron.core import parallel_state

    engine = run.engine
    return layout_free.save_job(
        engine.module,
        engine.optimizer,
        directory,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=run.cfg.parallel.tensor_parallel,
        dp_rank=run.dp_rank,
        dp_size=run.dp_size,
        vocab_size=run.cfg.model.vocab_size,
        extra={
            "zero_stage": run.cfg.parallel.zero_stage,
            "scheduler_last_epoch": int(run.scheduler.last_epoch),
            "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples),
            "skipped_steps": int(engine.skipped_steps),
        },
    )


DATA_STATE = "data_state.json"


def _data_state_job(
    run: Any, directory: Path, loader: StreamingLoader | None
) -> checkpoint_writer.Job | None:
    """data_state.json (data/state.py's saved_file): the segment with its taken sets once, from
    data-parallel rank 0 (global rank 0, which writes the file), and one record per
    data-parallel rank, gathered to it now from the first tensor-parallel rank of each (its
    peers hold the same state and send nothing): the bytes gathered grow with the
    data-parallel size, not the tensor-parallel one, and no rank but the writer receives
    any."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_rank() != 0:
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
        return checkpoint_writer.flushed(directory, DATA_STATE)

    return write


def data_state(path: Path) -> SavedState | None:
    """A checkpoint's data state as typed records (data/state.py's read_saved: the one record
    this del-megatron writes, or the list of per-rank states written before it; None: saved
    without a loader). CheckpointError names the file and what is wrong with it."""
    file = path / DATA_STATE
    try:
        return read_saved(json.loads(file.read_text()))
    except DataError as err:
        raise CheckpointError(f"{path}: {err}") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file}: unreadable ({one_line(err)})") from None


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generators: torch's, and on GPU the device's and megatron-core's
    tensor-parallel tracker (dropout inside tensor-parallel regions, recomputation)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "cuda": None}
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def derived_seed(seed: int, step: int, dp_rank: int) -> int:
    """The seed of a data-parallel replica resumed at step `step` on a new layout: a pure
    function of the run's seed, the step and the replica's position, so the same resume
    draws the same numbers whatever the saved layout was. Tensor-parallel ranks of one
    replica share it (dropout outside tensor-parallel regions must agree across them);
    megatron's tracker adds the tensor-parallel rank for the regions inside."""
    digest = hashlib.sha256(f"{seed}/{step}/{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: torch.manual_seed takes it


def seed_rng(seed: int, device: torch.device) -> None:
    from ..models.device import seed_rngs

    seed_rngs(seed, cuda_tracker=device.type == "cuda")


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        if state.get("cuda_tracker"):
            tensor_parallel.get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (a final name, meta.json and files.json, which the
    save writes last), oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(PREFIX)
        and (p / "meta.json").is_file()
        and (p / checkpoint_files.INDEX).is_file()
    )


def resolve(resume: str, output_dir: str) -> Path | None:
    """'none' -> None; 'auto' and 'same' -> the newest complete checkpoint (None if there is
    none); anything else is a checkpoint directory that must exist and be whole
    (del_megatron/inputs.py: not one being written, its files list, every file at its
    size)."""
    if resume == "none":
        return None
    if resume in ("auto", "same"):  # same: auto, for the same config (resume_changes.py)
        found = complete_checkpoints(root_of(output_dir))
        return found[-1] if found else None
    path = Path(resume)
    try:
        inputs.check_whole(path, "--resume")
    except UserError as err:
        raise ConfigError(str(err)) from None
    if not (path / "meta.json").is_file():
        raise ConfigError(f"--resume {resume}: not a checkpoint directory (no meta.json)")
    return path


def saved_layout(meta: dict[str, Any]) -> dict[str, Any]:
    """The parallel layout a checkpoint was saved at (zero_stage None: saved before it was
    recorded)."""
    return {
        "tensor_parallel": meta.get("tensor_parallel"),
        "data_parallel": meta.get("data_parallel"),
        "zero_stage": meta.get("zero_stage"),
    }


def run_layout(cfg: Any, world: int) -> dict[str, Any]:
    return {
        "tensor_parallel": cfg.parallel.tensor_parallel,
        "data_parallel": cfg.data_parallel_size(world),
        "zero_stage": cfg.parallel.zero_stage,
    }


def changed(saved: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether `wanted` is another layout than the saved one, which DeepSpeed's per-rank
    state cannot serve (an unrecorded ZeRO stage is taken as unchanged: DeepSpeed itself then
    says whether its state loads)."""
    return any(
        saved[key] != wanted[key] for key in wanted if saved[key] is not None or key != "zero_stage"
    )


def describe(layout: dict[str, Any]) -> str:
    zero = "" if layout["zero_stage"] is None else f", ZeRO {layout['zero_stage']}"
    return (
        f"tensor parallel {layout['tensor_parallel']} x data parallel "
        f"{layout['data_parallel']}{zero}"
    )


def how_to_run(layout: dict[str, Any], world: Any) -> str:
    zero = "" if layout["zero_stage"] is None else f" parallel.zero_stage={layout['zero_stage']}"
    return f"parallel.tensor_parallel={layout['tensor_parallel']}{zero} on {world} processes"


def has_deepspeed_state(path: Path) -> bool:
    """Whether the checkpoint holds DeepSpeed's own state (written before the layout-free
    state became the one copy, or with train.layout_free_checkpoints=false)."""
    return (path / DEEPSPEED_TAG).is_dir()


def reads_layout_free(path: Path, saved: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a resume at `wanted` reads the layout-free state: at another layout, and at
    the saved one when it is the checkpoint's only optimizer state (DeepSpeed's, where
    written, is read at its own layout: the checkpoints written before the layout-free state
    was the one copy, or with train.layout_free_checkpoints=false)."""
    if changed(saved, wanted):
        return True
    return layout_free.has_state(path) and not has_deepspeed_state(path)


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
        if not layout_free.has_state(path):
            raise CheckpointError(
                f"{path}: saved at {describe(saved)} without the layout-free state (optim/), "
                f"this run is at {describe(wanted)}: resume at the saved layout "
                f"({how_to_run(saved, meta.get('world_size'))})"
            )
        try:
            layout_free.read_index(path)
        except layout_free.LayoutFreeError as err:
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
    """Every file the load will read, by size and header (training/checkpoint_files.py):
    the layout-free state's, or DeepSpeed's (`reads_layout_free`)."""
    try:
        if layout_free_state:
            needed = checkpoint_files.layout_free_files(layout_free.read_index(path))
        else:
            needed = checkpoint_files.deepspeed_files(meta)
        checkpoint_files.check_files(path, needed)
    except (checkpoint_files.ChecksumError, layout_free.LayoutFreeError) as err:
        raise CheckpointError(str(err)) from None


def verify_contents(run: Any, path: Path) -> None:
    """The checkpoint's files against their checksums, each rank hashing its share; the
    outcome agreed, so a corrupted file is refused on every rank."""
    found = checkpoint_files.verify_share(path, run.rank, run.world)
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
        _load_deepspeed(run, path)
    if changed(saved, wanted):
        if run.is_main:
            print(
                f"resuming at {describe(wanted)} (saved at {describe(saved)}): fp32 weights, "
                "Adam moments and steps and the schedule restored from the layout-free state",
                flush=True,
            )
    same_positions = all(saved[k] == wanted[k] for k in ("tensor_parallel", "data_parallel"))
    if not same_positions:
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


def _load_deepspeed(run: Any, path: Path) -> None:
    """DeepSpeed's own per-rank state, at its saved layout (bit-exact resume)."""
    try:
        loaded, _ = run.engine.load_checkpoint(
            str(path),
            tag=DEEPSPEED_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=True,
        )
    except Exception as err:  # DeepSpeed raises whatever its torch.load or asserts raise
        raise CheckpointError(
            f"{path}: cannot load the model/optimizer state "
            f"({type(err).__name__}: {one_line(str(err))[:300]})"
        ) from None
    if loaded is None:
        raise CheckpointError(f"{path}: no DeepSpeed state under tag '{DEEPSPEED_TAG}'")
    # DeepSpeed's ZeRO 1/2 load unlinks the moments from its safe_get API, which the next
    # layout-free save reads them through
    layout_free.ensure_adam_state(run.engine.optimizer)


def _load_layout_free(run: Any, path: Path) -> None:
    """Masters, moments and steps from optim/ (at any layout, the saved one included), the
    model's weights from the masters, the schedule and the engine's counters from the
    index."""
    from megatron.core import parallel_state

    engine = run.engine
    index = layout_free.load(
        engine.module,
        engine.optimizer,
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
    engine.global_steps = int(index["global_steps"])
    engine.global_samples = int(index["global_samples"])
    engine.skipped_steps = int(index["skipped_steps"])


def remove_partial(output_dir: str) -> None:
    """Drop directories of saves that never completed (rank 0)."""
    root = root_of(output_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
