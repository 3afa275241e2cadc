"""Corpus files -> tokenized webdataset shards and a manifest (format: docs/data.md).

Tokenization runs in a process pool, in order, so identical input gives byte-identical
shards. A build is written into a staging directory beside the output and put in place
whole when complete (`del_megatron.outputs`): a killed or failed build leaves the previous
one untouched, and nothing in the output directory that a build did not write is touched.
"""

from __future__ import annotations

import array
import hashlib
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

from del_megatron.data.format import (
    InputEntry,
    Manifest,
    ShardEntry,
    TokenizerInfo,
    encode_sample,
    end_of_archive,
)
from del_megatron.outputs import (
    abandon_output,
    begin_output,
    commit_output,
    is_no_space,
    no_space,
)
from del_megatron.tokenizer import Tokenizer

from .readers import Fields, InputError, InputReport, OnError, Record, expand_inputs, read_records

SHARD_PATTERN = "shard-{:05d}.tar"
MANIFEST_NAME = "manifest.json"
TMP_SUFFIX = ".tmp"  # a shard being written, inside the staging directory
# A task for a tokenizer process: records up to this many characters of text. Its result (4
# bytes a token, ~1 byte a character) must fit the 64 KiB pipe buffer, or the tokenizer
# process blocks until this one reads it: 256 ~180-token documents a task gave 0.83x of a
# plain encode loop, 64 gave 0.93x.
CHUNK_CHARS = 40_000

_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _tokenizer
    _tokenizer = Tokenizer(tokenizer_path)


def tokenize_records(records: list[Record]) -> list[tuple[bytes, bytes | None]]:
    """Records -> (uint32 little-endian token bytes, uint8 mask bytes or None) per document,
    in a tokenizer process. It does as little else as it can: tokenizing is the build's cost
    (array.array packs ids ~4x faster than numpy at document sizes)."""
    assert _tokenizer is not None
    encode, pack = _tokenizer.encode, _pack_ids
    out = []
    for record in records:
        if record.__class__ is str:
            out.append((pack(encode(record)), None))
        else:
            prompt, response = encode(record[0]), encode(record[1])
            mask = bytes(len(prompt)) + b"\x01" * len(response)
            out.append((pack(prompt + response), mask))
    return out


def _pack_ids(ids: list[int]) -> bytes:
    packed = array.array("I", ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


_BIG_ENDIAN = sys.byteorder != "little"


def _chunks(records: Iterable[Record]) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    size = 0
    for record in records:
        chunk.append(record)
        size += len(record) if isinstance(record, str) else len(record[0]) + len(record[1])
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _ShardWriter:
    """Writes numbered shards of about `target_bytes` each, atomically."""

    def __init__(self, out_dir: Path, target_bytes: int) -> None:
        self.out_dir, self.target_bytes = out_dir, target_bytes
        self.entries: list[ShardEntry] = []
        self._open()

    def _open(self) -> None:
        self.name = SHARD_PATTERN.format(len(self.entries))
        self.tmp = self.out_dir / (self.name + TMP_SUFFIX)
        self.file = open(self.tmp, "wb")
        self.digest = hashlib.sha256()  # hashed as written: no second read of the shard
        self.samples = self.tokens = self.bytes = 0

    def _write(self, data: bytes) -> None:
        self.file.write(data)
        self.digest.update(data)
        self.bytes += len(data)

    def write(self, tokens: bytes, mask: bytes | None) -> None:
        """One document: token ids (uint32 LE bytes) and its loss mask (uint8 bytes) if any."""
        # plain ustar members with fixed metadata: byte-identical output, no per-file PAX
        # records (those cost ~1.8x in read speed)
        self._write(encode_sample(f"{self.samples:08d}", tokens, mask))
        self.samples += 1
        self.tokens += len(tokens) // 4
        if self.bytes >= self.target_bytes:
            self._close()
            self._open()

    def _close(self) -> None:
        self._write(end_of_archive(self.bytes))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.samples == 0:
            self.tmp.unlink()
            return
        self.tmp.replace(self.out_dir / self.name)
        self.entries.append(
            ShardEntry(
                name=self.name,
                samples=self.samples,
                tokens=self.tokens,
                bytes=self.bytes,
                sha256=self.digest.hexdigest(),
            )
        )

    def finish(self) -> list[ShardEntry]:
        self._close()
        return self.entries


def output_is_ours(out_dir: Path):
    """What of an existing output directory a build may replace: a readable manifest.json and
    the shards it lists. Anything else there is the user's."""
    from del_megatron.data.format import DataError, read_manifest

    listed: set[str] = set()
    manifest = out_dir / MANIFEST_NAME
    if manifest.is_file():
        try:
            listed = {MANIFEST_NAME, *(e.name for e in read_manifest(str(manifest)).shards)}
        except DataError:
            listed = set()  # not a manifest of ours
    return lambda path: path.name in listed and path.is_file()


def _records(files: list[Path], fields: Fields, on_error: OnError, reports: list[InputReport]):
    for path in files:
        report = InputReport(path)
        reports.append(report)
        yield from read_records(path, fields, on_error, report)


def build_shards(
    inputs: list[Path],
    out_dir: Path,
    tokenizer_path: Path,
    *,
    fields: Fields | None = None,
    shard_bytes: int = 64 << 20,
    workers: int = 1,
    progress: bool = True,
    on_error: OnError = "fail",
    force: bool = False,
    wait_for_lock: bool = False,
) -> Manifest:
    """Tokenize `inputs` into shards in `out_dir`; returns the manifest written there.

    The build goes into a staging directory beside `out_dir` and replaces an earlier build
    there only when complete: a failed build leaves the old one as it was. An `out_dir`
    holding files that no build wrote is refused unless `force` (which keeps them), one
    another process is building into unless `wait_for_lock` (which waits for it)."""
    fields = fields or Fields()
    files = expand_inputs(inputs)
    tokenizer = Tokenizer(tokenizer_path)  # fails here, not in a worker, on a bad tokenizer
    info = TokenizerInfo(
        fingerprint=tokenizer.fingerprint,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        source=tokenizer_path.name,
    )
    is_ours = output_is_ours(out_dir)
    staging = begin_output(out_dir, is_ours, force=force, wait=wait_for_lock)
    try:
        manifest = _build(
            files,
            staging,
            tokenizer_path,
            info,
            fields,
            shard_bytes,
            workers,
            progress,
            on_error,
        )
        commit_output(staging, out_dir, is_ours)
    except OSError as err:
        abandon_output(staging)
        if is_no_space(err):
            raise no_space(out_dir) from None
        raise InputError(f"{out_dir}: cannot write the build ({err.strerror or err})") from None
    except BaseException:
        abandon_output(staging)
        raise
    return manifest


def _build(
    files: list[Path],
    staging: Path,
    tokenizer_path: Path,
    info: TokenizerInfo,
    fields: Fields,
    shard_bytes: int,
    workers: int,
    progress: bool,
    on_error: OnError,
) -> Manifest:
    reports: list[InputReport] = []
    records = _records(files, fields, on_error, reports)
    writer = _ShardWriter(staging, shard_bytes)
    bar = tqdm(desc="tokenizing", unit="doc", disable=not progress)
    pool = None
    if workers > 0:  # tokenizer processes; this one reads the input and writes the shards
        pool = multiprocessing.get_context("fork").Pool(
            workers, initializer=_init_worker, initargs=(str(tokenizer_path),)
        )
        batches: Iterator[list[tuple[bytes, bytes | None]]] = pool.imap(
            tokenize_records, _chunks(records)
        )
    else:
        _init_worker(str(tokenizer_path))
        batches = map(tokenize_records, _chunks(records))
    try:
        for docs in batches:
            for tokens, mask in docs:
                writer.write(tokens, mask)
            bar.update(len(docs))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    entries = writer.finish()
    documents = sum(e.samples for e in entries)
    if documents == 0:
        raise InputError(f"no documents in {', '.join(str(f) for f in files)}")
    manifest = Manifest(
        tokenizer=info,
        shards=tuple(entries),
        documents=documents,
        tokens=sum(e.tokens for e in entries),
        inputs=tuple(
            InputEntry(
                name=str(r.path),
                bytes=r.bytes,
                sha256=r.sha256,
                documents=r.documents,
                skipped=r.skipped,
                damage=tuple(r.damage),
            )
            for r in reports
        ),
    )
    (staging / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest
