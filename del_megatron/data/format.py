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
from typing import IO, TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import UserError

if TYPE_CHECKING:
    from .config import DataConfig

FORMAT_VERSION = 2  # 2: inputs are records (size, SHA-256, documents); 1: file names
TOKENS_EXT = "tokens"
MASK_EXT = "mask"


class DataError(UserError, RuntimeError):
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


class InputEntry(BaseModel):
    """One input file of a build: read to its end, what it gave and what was left out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # the path as given to the build
    bytes: int  # every byte was read
    sha256: str
    documents: int  # documents taken from it
    skipped: int = 0  # damaged records left out (on_error=skip)
    damage: tuple[str, ...] = ()  # the first few of them, each naming its place


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = FORMAT_VERSION
    tokenizer: TokenizerInfo
    shards: tuple[ShardEntry, ...]
    documents: int
    tokens: int
    inputs: tuple[InputEntry | str, ...] = ()  # str: a version 1 manifest

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"


@dataclass(frozen=True)
class Document:
    tokens: np.ndarray  # [n] uint32
    mask: np.ndarray | None  # [n] uint8, None = every token trained on


# ---- writing ---------------------------------------------------------------------------

BLOCK = 512
RECORD = 20 * BLOCK  # tar's default record size; archives are padded to a multiple of it


def ustar_member(name: str, data: bytes) -> bytes:
    """One regular-file member as a plain ustar header and its padded data: mode 0444, owner
    0/0 without names, mtime 0, no PAX records, so equal input gives equal bytes. tarfile
    builds a header at ~60 us, as long as tokenizing a document; this takes a few."""
    encoded = name.encode("utf-8")
    if len(encoded) > 100:
        raise ValueError(f"member name too long for ustar: {name}")
    header = bytearray(BLOCK)
    header[0 : len(encoded)] = encoded
    header[100:108] = b"0000444\0"  # mode
    header[108:116] = b"0000000\0"  # uid
    header[116:124] = b"0000000\0"  # gid
    header[124:136] = b"%011o\0" % len(data)  # size
    header[136:148] = b"00000000000\0"  # mtime
    header[148:156] = b"        "  # checksum field counts as spaces
    header[156:157] = b"0"  # regular file
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\0 " % sum(header)
    padding = (-len(data)) % BLOCK
    return bytes(header) + data + bytes(padding)


def end_of_archive(written: int) -> bytes:
    """Two zero blocks, then zeros up to the next record boundary."""
    size = written + 2 * BLOCK
    return bytes(2 * BLOCK + (-size) % RECORD)


def encode_sample(key: str, tokens: bytes, mask: bytes | None) -> bytes:
    """The tar members of one document: {key}.tokens (uint32 little-endian ids) and, if it
    has one, {key}.mask (uint8, 1 = trained on)."""
    out = ustar_member(f"{key}.{TOKENS_EXT}", tokens)
    if mask is not None:
        out += ustar_member(f"{key}.{MASK_EXT}", mask)
    return out


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
    """The manifest at `url` (for a pipe: template, the command with {name}=manifest.json)."""
    location = url.replace("{name}", "manifest.json") if url.startswith("pipe:") else url
    with open_url(location, allow_pipe=allow_pipe) as f:
        raw = f.read()
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        hint = (
            "; corpora become shards with `data-tools build FILE -o DIR --tokenizer MODEL`"
            if url.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".parquet", ".txt"))
            else ""
        )
        raise DataError(f"{url}: not a shard manifest ({where}: {first['msg']}){hint}") from None
    if manifest.version > FORMAT_VERSION:
        raise DataError(
            f"{url}: manifest version {manifest.version} is newer than this del-megatron reads "
            f"({FORMAT_VERSION}); update del-megatron"
        )
    return manifest


def check_listed_shards(url: str, manifest: Manifest) -> None:
    """Before a run: the manifest lists shards, and each local one exists with its listed
    size (remote and pipe: sources are checked when read)."""
    if not manifest.shards:
        raise DataError(f"{url}: the manifest lists no shards")
    if url.startswith(("http://", "https://", "pipe:")):
        return
    for entry in manifest.shards:
        location = resolve(url, entry.name)
        path = Path(location[len("file://") :] if location.startswith("file://") else location)
        if not path.is_file():
            raise DataError(f"{path}: listed in {url} but missing")
        if path.stat().st_size != entry.bytes:
            raise DataError(
                f"{path}: {path.stat().st_size} bytes, {url} lists {entry.bytes} (truncated or "
                "replaced?)"
            )


# ---- reading ---------------------------------------------------------------------------


def load_manifests(
    cfg: DataConfig, fingerprint: str | None = None, *, check_shards: bool = False
) -> list[tuple[str, Manifest]]:
    """Every source's manifest; all must share one tokenizer, `fingerprint` if given.
    check_shards: also that every local shard listed is there at its size (preflight)."""
    manifests: list[tuple[str, Manifest]] = []
    for source in cfg.sources:
        manifest = read_manifest(source.manifest, allow_pipe=cfg.allow_pipe)
        if check_shards:
            check_listed_shards(source.manifest, manifest)
        want = fingerprint or (manifests[0][1].tokenizer.fingerprint if manifests else None)
        if want is not None and manifest.tokenizer.fingerprint != want:
            raise DataError(
                f"{source.manifest}: shards were tokenized with tokenizer "
                f"{manifest.tokenizer.fingerprint[:18]}... ({manifest.tokenizer.source}), "
                f"training uses {want[:18]}...; rebuild the shards with the training tokenizer"
            )
        manifests.append((source.manifest, manifest))
    return manifests


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
        docs = list(_samples(data))
    except (tarfile.TarError, ValueError) as err:
        raise DataError(f"{url}: unreadable tar: {err}") from None
    tokens = sum(len(d.tokens) for d in docs)
    if len(docs) != entry.samples or tokens != entry.tokens:
        raise DataError(
            f"{url}: {len(docs)} samples / {tokens} tokens, manifest says "
            f"{entry.samples} / {entry.tokens}"
        )
    return docs


def _members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """(name, content) of each member of a shard as build_shards writes it: plain ustar
    headers, regular files. tarfile parses at ~70 us a member, a third of the loader's time at
    ~200-token documents; the whole shard is already checked against its SHA-256, so this
    reads just the name and size fields. Any other layout goes to webdataset's tar reader."""
    view = memoryview(data)
    offset, end = 0, len(data)
    while offset + 512 <= end:
        header = view[offset : offset + 512]
        if header[0] == 0:  # end-of-archive blocks
            return
        if header[257:262] != b"ustar" or header[156] not in (0x30, 0) or header[345] != 0:
            yield from _members_via_webdataset(data)
            return
        name = bytes(header[0:100]).split(b"\0", 1)[0].decode("utf-8")
        size = int(bytes(header[124:136]).split(b"\0", 1)[0].strip() or b"0", 8)
        start = offset + 512
        if start + size > end:
            raise tarfile.ReadError(f"member {name} is cut short")
        yield name, bytes(view[start : start + size])
        offset = start + (size + 511) // 512 * 512
    raise tarfile.ReadError("unexpected end of data (no end-of-archive marker)")


def _members_via_webdataset(data: bytes) -> Iterator[tuple[str, bytes]]:
    from webdataset.tariterators import tar_file_iterator

    for item in tar_file_iterator(io.BytesIO(data)):
        yield item["fname"], item["data"]


def _samples(data: bytes) -> Iterator[Document]:
    key, parts = None, {}
    for fname, content in _members(data):
        stem, _, ext = fname.rpartition(".")
        if stem != key and key is not None:
            yield _document(key, parts)
            parts = {}
        key = stem
        parts[ext] = content
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
