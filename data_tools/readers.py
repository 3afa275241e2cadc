"""Documents from corpus files: jsonl, jsonl.gz, jsonl.zst, parquet, plain text.

A record is either one text field or a prompt/response pair (instruction data; the prompt's
tokens get loss mask 0). Plain text files are one document each.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt")


class InputError(ValueError):
    """An input file that cannot be read as a corpus; the message names file and field."""


@dataclass(frozen=True)
class Fields:
    text: str = "text"
    prompt: str | None = None
    response: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) != (self.response is None):
            raise InputError("give both --prompt-field and --response-field, or neither")


# A record: the text, or (prompt, response).
Record = str | tuple[str, str]


def suffix_of(path: Path) -> str:
    for suffix in SUFFIXES:
        if path.name.endswith(suffix):
            return suffix
    raise InputError(f"{path}: unknown input format (expected one of {', '.join(SUFFIXES)})")


def expand_inputs(paths: list[Path]) -> list[Path]:
    """Files as given, directories expanded to their corpus files, in sorted order."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
            if not found:
                raise InputError(f"{path}: no {', '.join(SUFFIXES)} files in this directory")
            files += found
        elif path.is_file():
            suffix_of(path)
            files.append(path)
        else:
            raise InputError(f"{path}: no such file or directory")
    return files


def _pick(record: dict, fields: Fields, where: str) -> Record:
    try:
        if fields.prompt is not None:
            prompt, response = record[fields.prompt], record[fields.response]
            if not isinstance(prompt, str) or not isinstance(response, str):
                raise InputError(
                    f"{where}: fields {fields.prompt!r}/{fields.response!r} are not text"
                )
            return (prompt, response)
        text = record[fields.text]
    except KeyError as err:
        raise InputError(f"{where}: no field {err.args[0]!r} (have {sorted(record)})") from None
    if not isinstance(text, str):
        raise InputError(f"{where}: field {fields.text!r} is {type(text).__name__}, not text")
    return text


def _jsonl_lines(path: Path, suffix: str) -> Iterator[str]:
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            yield from f
    elif suffix == ".jsonl.gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            yield from f
    else:
        import zstandard

        with open(path, "rb") as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            yield from io.TextIOWrapper(reader, encoding="utf-8")


def read_records(path: Path, fields: Fields) -> Iterator[Record]:
    suffix = suffix_of(path)
    if suffix == ".txt":
        yield path.read_text(encoding="utf-8")
        return
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        columns = [fields.prompt, fields.response] if fields.prompt else [fields.text]
        try:
            table = pq.read_table(path, columns=columns)
        except KeyError as err:
            raise InputError(f"{path}: no column {err}") from None
        except Exception as err:  # pyarrow raises several of its own types
            raise InputError(f"{path}: not a readable parquet file ({err})") from None
        for i, row in enumerate(table.to_pylist()):
            yield _pick(row, fields, f"{path} row {i}")
        return
    try:
        for number, line in enumerate(_jsonl_lines(path, suffix), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path} line {number}: not JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise InputError(f"{path} line {number}: not a JSON object")
            yield _pick(record, fields, f"{path} line {number}")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read ({err})") from None
