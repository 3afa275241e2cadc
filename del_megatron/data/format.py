"""The on-disk format of tokenized shards and their manifest (docs/data.md), read and written
in this one module.

A shard is an uncompressed POSIX tar (no PAX headers) of samples, one document each:
`{key}.tokens` (uint32 little-endian token ids) and, for instruction data,
`{key}.mask` (uint8, 1 where the token is trained on, 0 for prompt tokens). The manifest
(JSON) lists every shard with its sample count, token count and SHA-256, and the tokenizer
(fingerprint, vocabulary size, EOS id).
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

FORMAT_VERSION = 1
TOKENS_EXT = "tokens"
MASK_EXT = "mask"


class DataError(RuntimeError):
    """A shard, manifest or source that cannot be read as it should; names the file."""


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # file name beside the manifest
    samples: int
    tokens: int
    bytes: int
    sha256: str


class TokenizerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    fingerprint: str
    vocab_size: int
    eos_id: int
    source: str  # file name the shards were tokenized with (informative)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = FORMAT_VERSION
    tokenizer: TokenizerInfo
    shards: tuple[ShardEntry, ...]
    documents: int
    tokens: int
    inputs: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"


@dataclass(frozen=True)
class Document:
    tokens: np.ndarray  # [n] uint32
    mask: np.ndarray | None  # [n] uint8, None = every token trained on


# ---- writing ---------------------------------------------------------------------------


def encode_sample(key: str, doc: Document) -> dict[str, bytes | str]:
    sample: dict[str, bytes | str] = {
        "__key__": key,
        TOKENS_EXT: doc.tokens.astype("<u4", copy=False).tobytes(),
    }
    if doc.mask is not None:
        sample[MASK_EXT] = doc.mask.astype(np.uint8, copy=False).tobytes()
    return sample


# ---- opening sources -------------------------------------------------------------------


def resolve(base: str, name: str) -> str:
    """The location of `name` beside the manifest at `base` (path, file://, http(s)://, or a
    pipe: command template with '{name}')."""
    if base.startswith("pipe:"):
        return base.replace("{name}", name)
    if base.startswith(("http://", "https://", "file://")):
        return base.rsplit("/", 1)[0] + "/" + name
    return str(Path(base).parent / name)


def open_url(url: str, *, allow_pipe: bool) -> IO[bytes]:
    """A binary stream for a local path, file://, http(s):// URL or (if allowed) pipe: command.

    pipe: commands run without a shell (split like a shell would, no expansion).
    """
    try:
        if url.startswith("pipe:"):
            if not allow_pipe:
                raise DataError(
                    f"{url}: pipe: sources run commands; enable them with data.allow_pipe=true"
                )
            proc = subprocess.Popen(shlex.split(url[len("pipe:") :]), stdout=subprocess.PIPE)
            data = proc.stdout.read()
            if proc.wait() != 0:
                raise DataError(f"{url}: command exited with status {proc.returncode}")
            return io.BytesIO(data)
        if url.startswith(("http://", "https://")):
            return urllib.request.urlopen(url, timeout=60)
        path = url[len("file://") :] if url.startswith("file://") else url
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{url}: no such file") from None
    except OSError as err:
        raise DataError(f"{url}: cannot open: {err}") from None


def read_manifest(url: str, *, allow_pipe: bool = False) -> Manifest:
    with open_url(url, allow_pipe=allow_pipe) as f:
        raw = f.read()
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise DataError(f"{url}: not a shard manifest ({where}: {first['msg']})") from None


# ---- reading ---------------------------------------------------------------------------


def read_shard(url: str, entry: ShardEntry, *, allow_pipe: bool) -> list[Document]:
    """Every document of one shard, after checking its size, checksum and counts against the
    manifest (a truncated tar can look complete to tarfile)."""
    with open_url(url, allow_pipe=allow_pipe) as f:
        data = f.read()
    if len(data) != entry.bytes:
        raise DataError(f"{url}: {len(data)} bytes, manifest says {entry.bytes} (truncated?)")
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise DataError(f"{url}: checksum differs from the manifest (corrupted)")
    try:
        docs = list(_samples(io.BytesIO(data)))
    except (tarfile.TarError, ValueError) as err:
        raise DataError(f"{url}: unreadable tar: {err}") from None
    tokens = sum(len(d.tokens) for d in docs)
    if len(docs) != entry.samples or tokens != entry.tokens:
        raise DataError(
            f"{url}: {len(docs)} samples / {tokens} tokens, manifest says "
            f"{entry.samples} / {entry.tokens}"
        )
    return docs


def _samples(stream: IO[bytes]) -> Iterator[Document]:
    from webdataset.tariterators import tar_file_iterator

    key, parts = None, {}
    for item in tar_file_iterator(stream):
        stem, _, ext = item["fname"].rpartition(".")
        if stem != key and key is not None:
            yield _document(key, parts)
            parts = {}
        key = stem
        parts[ext] = item["data"]
    if key is not None:
        yield _document(key, parts)


def _document(key: str, parts: dict[str, bytes]) -> Document:
    if TOKENS_EXT not in parts:
        raise ValueError(f"sample {key} has no .{TOKENS_EXT} member")
    tokens = np.frombuffer(parts[TOKENS_EXT], dtype="<u4")
    mask = np.frombuffer(parts[MASK_EXT], dtype=np.uint8) if MASK_EXT in parts else None
    if mask is not None and len(mask) != len(tokens):
        raise ValueError(f"sample {key}: {len(mask)} mask bytes for {len(tokens)} tokens")
    return Document(tokens=tokens, mask=mask)
