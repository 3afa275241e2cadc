"""A checkpoint directory by name: where checkpoints live, which are complete, which one a
resume means, the partial saves a start removes, and the data state file's reader.

```
<output_dir>/checkpoints/step-NNNNNNN/        complete: meta.json and files.json present
<output_dir>/checkpoints/.tmp-step-NNNNNNN/   being written, or a killed save's: ignored
<output_dir>/checkpoints/.tmp-old-step-N/     out of the namespace, being deleted
```

The files inside are docs/checkpoints.md's; `save.py` writes them, `load.py` reads them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import inputs
from ..checksums import INDEX
from ..config import ConfigError
from ..data import DataError
from ..data.state import SavedState, read_saved
from ..errors import UserError, one_line

PREFIX = "step-"
TMP_PREFIX = inputs.BEING_WRITTEN  # what readers refuse (del_megatron/inputs.py)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the directory."""


def root_of(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


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


def remove_partial(output_dir: str) -> None:
    """Drop directories of saves that never completed (rank 0)."""
    root = root_of(output_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


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
