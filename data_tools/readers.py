"""Documents from corpus files: jsonl, jsonl.gz, jsonl.zst, parquet, plain text, each read to
its real end or refused.

A record is either one text field or a prompt/response pair (instruction data; the prompt's
tokens get loss mask 0). Plain text files are one document each.

Complete or refused: a compressed stream must end with its end-of-stream marker (gzip's
trailer, a whole zstd frame), every byte of the file is read (and hashed), the last line of a
jsonl file is accepted without its newline only if it is a complete record, and text must be
UTF-8. A damaged record or stream stops the build with the file and the line or byte offset
named, unless `on_error="skip"`: then a damaged record is left out and counted, and a damaged
stream ends that file's documents where the damage starts; both are recorded per input
(`InputReport`), so the manifest says what came from where.
"""

from __future__ import annotations

import difflib
import gzip
import hashlib
import json
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from del_megatron.errors import UserError

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt")
OnError = Literal["fail", "skip"]
READ_SIZE = 1 << 20


class InputError(UserError, ValueError):
    """An input file that cannot be read as a corpus; the message names file and place."""


@dataclass(frozen=True)
class Fields:
    text: str = "text"
    prompt: str | None = None
    response: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) != (self.response is None):
            raise InputError("give both --prompt-field and --response-field, or neither")

    def missing(self, name: str, have: list[str]) -> str:
        """'no field X (have [...])' with the option that picks another field: the fix."""
        if self.prompt is None:
            fix = "--text-field NAME (or --prompt-field/--response-field for pairs)"
        else:
            fix = "--prompt-field/--response-field NAME"
        close = difflib.get_close_matches(name, have, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"no field {name!r} (have {sorted(have)}); {hint}choose it with {fix}"


# A record: the text, or (prompt, response).
Record = str | tuple[str, str]


@dataclass
class InputReport:
    """What one input gave: its size and SHA-256 (of every byte, read to the end), the
    documents taken, and under on_error=skip what was left out."""

    path: Path
    bytes: int = 0
    sha256: str = ""
    documents: int = 0
    skipped: int = 0  # damaged records left out
    damage: list[str] = field(default_factory=list)  # the first few, each naming the place


def suffix_of(path: Path) -> str:
    name = path.name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise InputError(f"{path}: unknown input format (expected one of {', '.join(SUFFIXES)})")


def expand_inputs(paths: list[Path]) -> list[Path]:
    """Files as given, directories expanded to every file below them (hidden ones aside), in
    sorted order. A file of another format in a directory is refused as it would be by name:
    nothing in the input is passed over silently. Symbolic links are followed, to files and
    to directories; a directory or file reached a second time (a link loop, or two links to
    one place) is read once and the second path named on stderr; a link to nothing, a
    directory that cannot be listed and anything that is not a file or directory (a fifo)
    are refused."""
    files: list[Path] = []
    seen: dict[Path, Path] = {}  # real path -> the path it was first reached by
    for path in paths:
        if path.is_dir():
            found = sorted(_files_below(path, seen))
            if not found:
                raise InputError(f"{path}: no files in this directory")
            for p in found:
                suffix_of(p)
            files += found
        elif path.is_file():
            suffix_of(path)
            if _first_visit(path, seen):
                files.append(path)
        elif path.is_symlink():
            raise InputError(
                f"{path}: a symbolic link to {os.readlink(path)}, which does not exist"
            )
        elif path.exists():
            raise InputError(f"{path}: not a file or directory")
        else:
            raise InputError(f"{path}: no such file or directory")
    return files


def _first_visit(path: Path, seen: dict[Path, Path]) -> bool:
    """Whether `path` leads somewhere not reached before; says so on stderr when not."""
    real = path.resolve()
    if real in seen:
        print(
            f"data-tools: {path} is {seen[real]} again (a symbolic link): read once",
            file=sys.stderr,
        )
        return False
    seen[real] = path
    return True


def _files_below(directory: Path, seen: dict[Path, Path]) -> list[Path]:
    """Every file below `directory`, links followed once (see expand_inputs)."""
    if not _first_visit(directory, seen):
        return []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as err:
        raise InputError(f"{directory}: cannot list ({err.strerror or err})") from None
    found = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        path = Path(entry.path)
        if entry.is_dir():
            found += _files_below(path, seen)
        elif entry.is_file():
            if _first_visit(path, seen):
                found.append(path)
        elif entry.is_symlink():
            raise InputError(
                f"{path}: a symbolic link to {os.readlink(path)}, which does not exist"
            )
        else:
            raise InputError(f"{path}: not a file or directory")
    return found


class _Hashed:
    """A binary file read through: counts and hashes every byte handed out."""

    def __init__(self, path: Path, report: InputReport) -> None:
        self.file = open(path, "rb")
        self.report = report
        self.digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.digest.update(data)
        self.report.bytes += len(data)
        return data

    def close(self) -> None:
        self.file.close()
        self.report.sha256 = self.digest.hexdigest()


def _drain(raw: _Hashed) -> int:
    """Read what the decoder left after its stream ended; returns those bytes' count."""
    extra = 0
    while chunk := raw.read(READ_SIZE):
        extra += len(chunk)
    return extra


class Damage(Exception):
    """Raised inside a reader at a damaged place; turned into InputError or a skip."""

    def __init__(self, where: str, *, stream: bool) -> None:
        super().__init__(where)
        self.stream = stream  # the rest of the file cannot be read


def _gzip_bytes(raw: _Hashed) -> Iterator[bytes]:
    decoder = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[arg-type]
    try:
        while chunk := decoder.read(READ_SIZE):
            yield chunk
    except EOFError:
        raise Damage(
            f"truncated: the compressed stream ends at byte {raw.report.bytes} "
            "without its end marker",
            stream=True,
        ) from None
    except (gzip.BadGzipFile, zlib.error, OSError) as err:
        raise Damage(
            f"corrupt compressed data near byte {raw.report.bytes} ({err})", stream=True
        ) from None


def _zstd_bytes(raw: _Hashed) -> Iterator[bytes]:
    """Every frame decompressed; the input must end exactly at the end of a frame, and a
    frame that declares its size (zstd writes it when it knows it) must give that size."""
    import zstandard

    pending = raw.read(READ_SIZE)
    if not pending:
        raise Damage("empty: not a zstd stream", stream=True)
    while pending:  # one frame a turn
        decoder = zstandard.ZstdDecompressor().decompressobj()
        try:
            declared = zstandard.get_frame_parameters(pending).content_size
        except zstandard.ZstdError:
            declared = -1  # a header cut short: the decoder says what is wrong below
        produced = 0
        data = pending
        while True:
            try:
                out = decoder.decompress(data)
            except zstandard.ZstdError as err:
                raise Damage(
                    f"corrupt compressed data near byte {raw.report.bytes} ({err})", stream=True
                ) from None
            produced += len(out)
            if out:
                yield out
            if decoder.eof:
                pending = decoder.unused_data or raw.read(READ_SIZE)
                break
            data = raw.read(READ_SIZE)
            if not data:
                raise Damage(
                    f"truncated: the compressed stream ends at byte {raw.report.bytes} inside "
                    "a frame",
                    stream=True,
                )
        if declared >= 0 and declared != zstandard.CONTENTSIZE_UNKNOWN and produced != declared:
            raise Damage(
                f"corrupt compressed data: a frame declares {declared} bytes and gives {produced}",
                stream=True,
            )


def _plain_bytes(raw: _Hashed) -> Iterator[bytes]:
    while chunk := raw.read(READ_SIZE):
        yield chunk


def _lines(chunks: Iterator[bytes]) -> Iterator[tuple[bytes, bool]]:
    """(line without its newline, whether it had one)."""
    rest = b""
    for chunk in chunks:
        rest += chunk
        *complete, rest = rest.split(b"\n")
        for line in complete:
            yield line, True
    if rest:
        yield rest, False


def _pick(record: dict, fields: Fields, where: str) -> Record:
    try:
        if fields.prompt is not None:
            prompt, response = record[fields.prompt], record[fields.response]
            if not isinstance(prompt, str) or not isinstance(response, str):
                raise Damage(
                    f"{where}: fields {fields.prompt!r}/{fields.response!r} are not text",
                    stream=False,
                )
            return (prompt, response)
        text = record[fields.text]
    except KeyError as err:
        raise Damage(
            f"{where}: {fields.missing(err.args[0], list(record))}", stream=False
        ) from None
    if not isinstance(text, str):
        raise Damage(
            f"{where}: field {fields.text!r} is {type(text).__name__}, not text", stream=False
        )
    return text


def _jsonl_records(
    chunks: Iterator[bytes],
    fields: Fields,
    on_error: OnError,
    report: InputReport,
    plain: bool,
) -> Iterator[Record]:
    offset = 0
    for number, (line, terminated) in enumerate(_lines(chunks), start=1):
        where = f"line {number} (byte {offset}{'' if plain else ' of the decompressed text'})"
        offset += len(line) + terminated
        if not line.strip():
            continue
        try:
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise Damage(
                    f"{where}: not UTF-8 at byte {offset - len(line) - terminated + err.start}",
                    stream=False,
                ) from None
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                cut = "" if terminated else ", and the file ends inside it (truncated?)"
                raise Damage(f"{where}: not JSON ({err.msg}){cut}", stream=False) from None
            if not isinstance(record, dict):
                raise Damage(f"{where}: not a JSON object", stream=False)
            yield _pick(record, fields, where)
        except Damage as damage:
            _damaged(damage, on_error, report)


def _damaged(damage: Damage, on_error: OnError, report: InputReport) -> None:
    if on_error == "fail":
        joint = " " if str(damage).startswith(("line ", "row ")) else ": "
        raise InputError(f"{report.path}{joint}{damage}") from None
    report.skipped += 1
    if len(report.damage) < 5:
        report.damage.append(str(damage))


def read_records(
    path: Path, fields: Fields, on_error: OnError = "fail", report: InputReport | None = None
) -> Iterator[Record]:
    """Every record of `path`, read to its end (see the module's docstring)."""
    report = report if report is not None else InputReport(path)
    suffix = suffix_of(path)
    if suffix == ".parquet":
        yield from _parquet_records(path, fields, on_error, report)
        return
    try:
        raw = _Hashed(path, report)
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        if suffix == ".txt":
            data = b"".join(_plain_bytes(raw))
            try:
                yield data.decode("utf-8")
                report.documents += 1
            except UnicodeDecodeError as err:
                _damaged(Damage(f"not UTF-8 at byte {err.start}", stream=False), on_error, report)
            return
        chunks = {".jsonl": _plain_bytes, ".jsonl.gz": _gzip_bytes, ".jsonl.zst": _zstd_bytes}[
            suffix
        ](raw)
        try:
            records = _jsonl_records(chunks, fields, on_error, report, suffix == ".jsonl")
            for record in records:
                report.documents += 1
                yield record
        except Damage as damage:  # the stream itself: nothing after it can be read
            _damaged(damage, on_error, report)
        extra = _drain(raw)
        if extra and on_error == "fail":
            raise InputError(f"{path}: {extra} bytes after the end of the compressed stream")
    except OSError as err:
        raise InputError(
            f"{path}: cannot read at byte {report.bytes} ({err.strerror or err})"
        ) from None
    finally:
        raw.close()


def _parquet_records(
    path: Path, fields: Fields, on_error: OnError, report: InputReport
) -> Iterator[Record]:
    import pyarrow
    import pyarrow.parquet as pq

    columns = [fields.prompt, fields.response] if fields.prompt else [fields.text]
    try:
        schema = pq.read_schema(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise InputError(f"{path}: not a readable parquet file ({err})") from None
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise InputError(f"{path}: {fields.missing(missing[0], list(schema.names))}")
    try:
        table = pq.read_table(path, columns=columns)
    except (pyarrow.ArrowException, OSError) as err:
        raise InputError(f"{path}: not a readable parquet file ({err})") from None
    data = path.read_bytes()  # parquet is read by its footer: hash the whole file too
    report.bytes, report.sha256 = len(data), hashlib.sha256(data).hexdigest()
    for i, row in enumerate(table.to_pylist()):
        try:
            record = _pick(row, fields, f"row {i}")
        except Damage as damage:
            _damaged(damage, on_error, report)
            continue
        report.documents += 1
        yield record
