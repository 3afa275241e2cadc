"""A save made a checkpoint: once every rank's writer has finished (the loop learns it from
the step's agreement), every rank agrees that its files are written and that the job still
holds the output's lock, files.json is written, and rank 0 renames `.tmp-step-N-TOKEN` to
`step-N` (flushed to the disk), the lock compared before and after, then takes the
checkpoints beyond the newest `keep` out of the namespace and deletes them. A job whose lock
was taken over publishes nothing and stops on every rank in one line (locks.LockLost)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .. import collectives
from ..checksums import INDEX
from ..errors import one_line
from ..locks import LockLost
from ..outputs import fence, free_bytes, is_no_space, no_space
from . import files, writer
from .directory import TMP_PREFIX, CheckpointError, complete_checkpoints, remove_now, still_held
from .layout import Place
from .save import PendingSave, being_freed


def publish(place: Place, pending: PendingSave, *, run_ends: bool = False) -> Path:
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
    # a lost lock first: its new holder moved this staging away, so the writes failed too
    still_held(pending.tmp, leader=place.is_main)
    problems = [p for p in collectives.all_gather_object(problem) if p]
    if problems:
        if failure is not None and not _is_io_failure(failure):
            raise failure
        raise CheckpointError(problems[0])
    lost = None
    try:  # its gathers come first, then rank 0 writes files.json: a full disk meets that
        files.write_index(pending.tmp, entries, place.rank, place.world)
        if place.is_main:
            _rename_and_prune(pending, background=pending.background and not run_ends)
    except LockLost as err:  # rank 0's, at the rename: agreed below
        lost = _lost(err, pending)
    except Exception as err:
        try:  # a write into a staging a new holder moved away: the lost lock is the line
            if place.is_main:
                fence(pending.final.parent.parent)
        except LockLost as taken:
            lost = _lost(taken, pending)
        else:
            if not _is_io_failure(err):
                raise
            problem = _write_problem(err, pending)
    outcomes = collectives.all_gather_object((lost, problem))  # also a barrier
    if lost := next((lost for lost, _ in outcomes if lost), None):
        raise LockLost(lost)
    if problems := [p for _, p in outcomes if p]:
        raise CheckpointError(problems[0])
    return pending.final


def _lost(err: LockLost, pending: PendingSave) -> str:
    """Rank 0's lost lock, its line; its staging (its own name) removed, if still there."""
    remove_now(pending.tmp)
    return str(err)


def _rename_and_prune(pending: PendingSave, *, background: bool) -> None:
    """Rank 0's part of `publish`: files.json and the directory on the disk, the rename
    (flushed: then the checkpoint counts), the old checkpoints out of the namespace, then
    deleted (`background`: behind training). A directory is only ever deleted once out of
    the final namespace: a kill mid-delete leaves a .tmp- directory (the next start removes
    it), never a half-deleted step-N."""
    root = pending.final.parent
    output = root.parent
    writer.fsync(pending.tmp / INDEX)
    writer.sync_directory(pending.tmp)
    doomed = []
    # compare, then rename, then compare again (outputs.py, "Fencing"): the rename of a
    # staging a new holder moved away fails; the second check stops a job whose rename
    # came through just before the move (a complete checkpoint the new holder removes)
    fence(output)
    if pending.final.exists():  # the same step saved again (a resume from an older one)
        doomed.append(root / (TMP_PREFIX + "old-" + pending.final.name))
        os.replace(pending.final, doomed[-1])
    try:
        os.rename(pending.tmp, pending.final)  # onto a step-N another job made: refused
    except OSError:
        if doomed:  # put back what was moved aside for it
            with contextlib.suppress(OSError):
                os.rename(doomed.pop(), pending.final)
        raise  # publish asks the lock first: a staging moved away is said as the lost lock
    writer.sync_directory(root)
    fence(output)
    older = [p for p in complete_checkpoints(root) if p != pending.final]
    for old in older[: len(older) - (pending.keep - 1)] if pending.keep else []:
        doomed.append(root / (TMP_PREFIX + "old-" + old.name))
        os.replace(old, doomed[-1])
    writer.remove(doomed, background=background)


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
