"""Checksums of the files a command writes into a directory, and their verification when
read: `files.json` in that directory lists each file's size and SHA-256. Checkpoints carry
one (checkpoint/files.py says when it is written and checked); a data build's
shards carry theirs in the manifest (data/format.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .errors import UserError

INDEX = "files.json"
FORMAT = 1
READ_SIZE = 4 << 20


class ChecksumError(UserError, RuntimeError):
    """A file missing, cut short or changed against its index; the message names it."""


class HashingWriter:
    """A binary file written through: counts and hashes every byte (no second read)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> None:
        self.handle.write(data)
        self.digest.update(data)
        self.bytes += len(memoryview(data).cast("B"))

    def entry(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "sha256": self.digest.hexdigest()}


def hash_file(path: Path) -> dict[str, Any]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_SIZE):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def read_index(directory: Path) -> dict[str, dict[str, Any]] | None:
    """{relative path: {bytes, sha256}}; None for a directory without one (a checkpoint
    saved before the index existed)."""
    path = directory / INDEX
    if not path.exists():
        return None
    try:
        index = json.loads(path.read_text())
        if index.get("format") != FORMAT:
            raise ValueError(f"format {index.get('format')}, this version reads {FORMAT}")
        files = dict(index["files"])
        for entry in files.values():
            int(entry["bytes"]), str(entry["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ChecksumError(f"{path}: unreadable ({err})") from None
    return files


def verify_listed(directory: Path, names: list[str]) -> str | None:
    """The files `names` (relative to `directory`) hashed against its index; the first
    mismatch as a one-line message, or None (also when there is no index)."""
    index = read_index(directory)
    if index is None:
        return None
    for name in names:
        path = directory / name
        if name not in index:
            return f"{path}: not in {directory / INDEX}"
        try:
            found = hash_file(path)
        except OSError as err:
            return f"{path}: unreadable ({err.strerror or err})"
        if found != index[name]:
            return (
                f"{path}: its contents differ from the checksum in {directory / INDEX} (corrupted)"
            )
    return None
