"""The files of a checkpoint: their index (`files.json`: every
file's size and SHA-256), the start-up check of sizes and headers, and the verification of
contents when a checkpoint is loaded.

* **Written** by `write_index` at the end of a save, once every rank has written its files:
  each file a save's writer wrote is taken as it hashed it (checkpoint/writer.py;
  the layout-free state as it streamed, `HashingWriter`); any other file (DeepSpeed's own,
  with train.layout_free_checkpoints=false) is hashed by one rank, the ranks sharing the
  files round robin, and rank 0 writes the index.
* **Checked** by `check_files` before anything loads (the dry run, `--check` and the run
  share it through `load.check`): every file the load will read exists, has the size
  the index records and a whole header (a torch zip's end record, a safetensors header whose
  tensors end at the file's end). Contents are not read here.
* **Verified** by `verify_share` when the checkpoint is loaded: every rank hashes its share
  of the files, the ranks agree on the outcome, and a file whose bytes differ from the index
  is refused on every rank, naming it.

A directory without `files.json` (a save still being written or killed, a copy cut short,
or one saved before the index existed) is not a complete checkpoint: every reader refuses
it (del_megatron/inputs.py).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from ..checksums import (
    FORMAT,
    INDEX,
    ChecksumError,
    hash_file,
    read_index,
    verify_listed,
)
from ..inputs import check_whole


class CheckpointFileError(ChecksumError):
    """A checkpoint file missing, cut short or changed; the message names it."""


def _all_files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != INDEX
    )


def write_index(directory: Path, known: dict[str, dict[str, Any]], rank: int, world: int) -> None:
    """directory/files.json. Every rank calls it once its files are written (a collective):
    `known` holds the entries of the files this rank hashed as it wrote them."""
    from .. import collectives

    entries: dict[str, dict[str, Any]] = {}
    for part in collectives.all_gather_object(known):
        entries.update(part)
    rest = [name for name in _all_files(directory) if name not in entries]
    mine = {name: hash_file(directory / name) for name in rest[rank::world]}
    for part in collectives.all_gather_object(mine):
        entries.update(part)
    if rank == 0:
        index = {"format": FORMAT, "files": dict(sorted(entries.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=1))


# ---- sizes and headers --------------------------------------------------------------------


def _present(checkpoint: Path, name: str | tuple[str, ...]) -> Path:
    """The file a load reads: `name`, or the first of alternatives present (an engine's
    files named one way or another, engines/deepspeed.native_files)."""
    names = (name,) if isinstance(name, str) else name
    for each in names:
        if (checkpoint / each).is_file():
            return checkpoint / each
    raise CheckpointFileError(f"{checkpoint / names[0]}: missing (the resume reads it)")


def _check_header(path: Path, size: int) -> None:
    """A whole file by its header: a torch zip ends with its end-of-directory record, a
    safetensors file's tensors end where the file does."""
    with open(path, "rb") as handle:
        if path.suffix == ".pt":
            head = handle.read(4)
            handle.seek(max(0, size - (1 << 16) - 22))
            tail = handle.read()
            if head != b"PK\x03\x04" or b"PK\x05\x06" not in tail:
                raise CheckpointFileError(
                    f"{path}: unreadable (not a whole torch file: cut short?)"
                )
        elif path.suffix == ".safetensors":
            raw = handle.read(8)
            try:
                (length,) = struct.unpack("<Q", raw)
                header = json.loads(handle.read(min(length, size)))
                end = max(
                    (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                    default=0,
                )
            except (struct.error, ValueError, KeyError, TypeError) as err:
                raise CheckpointFileError(
                    f"{path}: unreadable (not a safetensors header: {err})"
                ) from None
            if 8 + length + end != size:
                raise CheckpointFileError(
                    f"{path}: unreadable ({size} bytes, its header says {8 + length + end}: "
                    "cut short?)"
                )


def check_files(checkpoint: Path, needed: list[str | tuple[str, ...]]) -> None:
    """The checkpoint whole (del_megatron/inputs.py: its files list, every file of it at its
    recorded size), and every file in `needed` (what the load reads) present with a whole
    header; contents are not read."""
    check_whole(checkpoint)
    for name in needed:
        path = _present(checkpoint, name)
        _check_header(path, path.stat().st_size)


# ---- contents -----------------------------------------------------------------------------


def verify_share(checkpoint: Path, rank: int, world: int) -> str | None:
    """This rank's share of the index's files hashed against it (round robin); the first
    mismatch as a one-line message, or None. The caller agrees the outcome over the ranks."""
    index = read_index(checkpoint)
    if index is None:
        return None
    return verify_listed(checkpoint, sorted(index)[rank::world])
