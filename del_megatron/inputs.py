"""Directories a command reads, refused in one line before anything of them is read when they
are not there or not whole. Every reader of a checkpoint or weights directory goes through
`check_whole` (del-train --resume and init.megatron, del-eval, del-convert, and so the
launchers' checks, which are del-train's), and a path the user gave that does not exist is
called missing by `missing`, with what the nearest existing directory above it holds (the
steps that do exist, say).

Whole means: not a directory still being written (a checkpoint's `.tmp-step-N`, a staging
`.NAME.partial-HOST-PID` of del_megatron/outputs.py), a files list (`files.json`,
del_megatron/checksums.py: written last, so a directory without one was never finished or
was copied in part), and every file it lists present at its size. Contents are verified
where a command reads them (checksums.verify_listed)."""

from __future__ import annotations

from pathlib import Path

from .checksums import INDEX, ChecksumError, read_index
from .errors import UserError

BEING_WRITTEN = ".tmp-"  # a checkpoint's directory until every rank's files are written
STAGING = ".partial-"  # an output's staging directory (outputs.staging_of)
SHOWN = 6  # entries beside a missing path shown in full (more: the first and last ones)


class IncompleteError(ChecksumError):
    """A checkpoint or weights directory that is not whole; the message names it."""


def missing(path: Path, what: str = "") -> UserError:
    """'PATH: does not exist (...)': the line for a path the user gave that is not there.
    Where it helps, what is there instead: the step directories beside it (a mistyped step),
    or, when even its parent is missing, the entries of the nearest directory above it that
    exists (a mistyped directory on the way)."""
    path = Path(path)
    label = f"{what} " if what else ""
    near = path.parent
    while not near.is_dir() and near != near.parent:
        near = near.parent
    try:
        entries = sorted(p.name for p in near.iterdir() if p.is_dir())
    except OSError:
        entries = []
    if near == path.parent:
        entries = [name for name in entries if name.startswith("step-")]
    if not entries:
        return UserError(f"{label}{path}: does not exist")
    count = f"; {len(entries)} in all" if len(entries) > SHOWN else ""
    if count:
        entries = [*entries[:2], "...", *entries[-3:]]
    return UserError(f"{label}{path}: does not exist ({near} holds {', '.join(entries)}{count})")


def require_directory(path: Path, what: str = "") -> None:
    """`path` exists and is a directory, or one line (`missing`)."""
    path = Path(path)
    if not path.exists():
        raise missing(path, what)
    if not path.is_dir():
        label = f"{what} " if what else ""
        raise UserError(f"{label}{path}: is not a directory")


def being_written(path: Path) -> bool:
    """Whether `path` is named as a directory still being written (or whose writer died)."""
    name = Path(path).name
    return name.startswith(BEING_WRITTEN) or (name.startswith(".") and STAGING in name)


def files_list(directory: Path) -> Path | None:
    """The files list that covers `directory`: its own files.json, else that of its model/
    (a weights directory written by del-convert hf-to-megatron lists its files there)."""
    for candidate in (directory, directory / "model"):
        if (candidate / INDEX).is_file():
            return candidate
    return None


def check_whole(directory: Path, what: str = "") -> Path:
    """A checkpoint or weights directory that is complete: it exists, its name is not that
    of one being written, it has a files list and every file listed is there at its size
    (a stat each; contents are not read). Returns the directory the list is in.
    IncompleteError (or `missing`) names what is wrong."""
    directory = Path(directory)
    label = f"{what} " if what else ""
    require_directory(directory, what)
    if being_written(directory):
        raise IncompleteError(
            f"{label}{directory}: a directory still being written (or whose writer was "
            "killed): not a complete checkpoint; use a finished one (step-NNNNNNN)"
        )
    listed = files_list(directory)
    if listed is None:
        raise IncompleteError(
            f"{label}{directory}: no {INDEX} (the list of its files, written last): not a "
            "complete checkpoint or weights directory (still being written, cut short, or "
            "copied in part)"
        )
    for name, entry in (read_index(listed) or {}).items():
        path = listed / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise IncompleteError(f"{path}: missing (listed in {listed / INDEX})") from None
        if size != entry["bytes"]:
            raise IncompleteError(
                f"{path}: unreadable ({size} bytes, {INDEX} says {entry['bytes']}: cut short "
                "or replaced?)"
            )
    return listed
