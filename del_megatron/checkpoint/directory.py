"""A checkpoint directory by name: where checkpoints live, which are complete, which one a
resume means, the partial saves a start removes, and the data state file's reader.

```
<output_dir>/checkpoints/step-NNNNNNN/              complete: meta.json and files.json present
<output_dir>/checkpoints/.tmp-step-NNNNNNN-TOKEN/   being written, or a killed save's: ignored
<output_dir>/checkpoints/.tmp-old-step-N/           out of the namespace, being deleted
```

TOKEN is the output lock's token of the job writing it (locks.py): two jobs that each think
they hold the output (one whose lease ran out while it was stopped, and the one that took
its lock over) never share, publish or remove each other's staging (outputs.py, "Fencing").

The files inside are docs/checkpoints.md's; `save.py` writes them, `load.py` reads them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .. import inputs
from ..checksums import INDEX
from ..config import ConfigError
from ..data import DataError
from ..data.state import SavedState, read_saved
from ..errors import UserError, one_line
from ..locks import LockLost
from ..outputs import agreed_fence

PREFIX = "step-"
TMP_PREFIX = inputs.BEING_WRITTEN  # what readers refuse (del_megatron/inputs.py)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the directory."""


def root_of(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def staging_of(root: Path, step: int, token: str | None) -> Path:
    """Where the save of `step` is written until it is published: the writing job's own name
    (`token`: its output lock's; None: a save outside a job that holds the lock)."""
    return root / f"{TMP_PREFIX}{PREFIX}{step:07d}{'-' + token if token else ''}"


def still_held(staging: Path, *, leader: bool) -> None:
    """Every rank: whether this job still holds the output `staging` is in (outputs.
    agreed_fence, a collective: the `leader` asks). A job whose lock was taken over raises
    LockLost on every rank, the leader having first removed `staging` (its own name)."""
    try:
        agreed_fence(staging.parent.parent, leader=leader)
    except LockLost:
        if leader:
            remove_now(staging)
        raise


def remove_now(directory: Path) -> None:
    """`directory` out of the namespace with one rename (a writer still writing into it by
    its path then fails), then deleted."""
    aside = directory.with_name(f"{TMP_PREFIX}old-{directory.name.removeprefix(TMP_PREFIX)}")
    try:
        os.rename(directory, aside)
    except FileNotFoundError:
        return
    except OSError:
        aside = directory
    shutil.rmtree(aside, ignore_errors=True)


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
        and (p / INDEX).is_file()
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


def remove_partial(output_dir: str, resume: str = "none", resumed: Path | None = None) -> None:
    """What a job does first once it holds the output's lock (rank 0): drop directories of
    saves that never completed, killed jobs' and those of a job whose lock it took over,
    each moved out of the namespace first (that job's writes into it then fail: outputs.py,
    "Fencing"). With `resume` 'auto' or 'same' (the newest checkpoint, chosen before the
    lock was taken: `resumed`, None when there was none), complete checkpoints newer than it
    are such a job's late publication: removed too, so the output is this job's alone."""
    root = root_of(output_dir)
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if p.name.startswith(TMP_PREFIX):
            remove_now(p)
    if resume in ("auto", "same"):
        newer = [p for p in complete_checkpoints(root) if resumed is None or p.name > resumed.name]
        for p in newer:
            remove_now(p)


DATA_STATE = "data_state.json"


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
