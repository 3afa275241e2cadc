"""The file-writing half of a checkpoint save, run behind training (or inline).

A save is cut in two (checkpoint/save.py): everything that needs the other ranks or
the live training state — the collectives, and a copy to host memory of what this rank
writes — runs on the training thread; what is left is a list of `Job`s that take host
copies only and write this rank's files. `start` runs them in a thread; the step goes on.
A checkpoint is published (the `.tmp-` rename) by the training thread once every rank has
agreed that its writer finished (training/signals.py carries the flag in the step's one
all-reduce), so the writer itself never issues a collective: no second stream of
collectives that could interleave with training's.

Each job writes its files, flushes them to the disk (fsync: a published checkpoint
survives a power loss, not only a kill) and returns their sizes and SHA-256 as written,
the entries of the checkpoint's files.json (checkpoint/files.py).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checksums import hash_file

# A job writes some files under the checkpoint directory and returns {relative path: entry}
Job = Callable[[], dict[str, dict[str, Any]]]


def fsync(path: Path) -> None:
    """Flush a file just written to the disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def flushed(directory: Path, relative: str) -> dict[str, dict[str, Any]]:
    """{relative: size and SHA-256} of a file just written, flushed to the disk first."""
    fsync(directory / relative)
    return {relative: hash_file(directory / relative)}


def sync_directory(path: Path) -> None:
    """Flush a directory's entries (a file created or renamed in it) to the disk."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


@dataclass
class Writing:
    """One rank's writer of one checkpoint: `written()` says whether it has finished (the
    flag the ranks agree on), `result()` waits for it and returns the files' entries or
    raises what a job raised."""

    thread: threading.Thread | None
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: BaseException | None = None

    def written(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def result(self) -> dict[str, dict[str, Any]]:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.entries


def _run(jobs: list[Job], writing: Writing, directories: list[Path]) -> None:
    try:
        for job in jobs:
            writing.entries.update(job())
        for directory in directories:
            if directory.is_dir():
                sync_directory(directory)
    except BaseException as err:  # handed to the training thread, which agrees and raises
        writing.error = err


def remove(directories: list[Path], *, background: bool) -> None:
    """Delete directories out of the checkpoint namespace already (deleting a checkpoint's
    files takes as long as a step): in a daemon thread when `background`, else now."""

    def delete() -> None:
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)

    if background:
        threading.Thread(target=delete, name="checkpoint-remover", daemon=True).start()
    else:
        delete()


def start(jobs: list[Job], directories: list[Path], *, background: bool) -> Writing:
    """Run `jobs` (host tensors only, no collective), then flush `directories`' entries:
    in a thread when `background`, else now. A daemon thread: a run that fails leaves an
    unpublished `.tmp-` directory, which the next start removes."""
    writing = Writing(thread=None)
    if not background:
        _run(jobs, writing, directories)
        return writing
    writing.thread = threading.Thread(
        target=_run, args=(jobs, writing, directories), name="checkpoint-writer", daemon=True
    )
    writing.thread.start()
    return writing
