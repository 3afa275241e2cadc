"""Property: for random corpora, any truncation or byte corruption of an input either fails
with one line naming the file, or yields exactly the documents an independent reference
reader finds intact (the standard library's gzip, zstandard's one-shot decompress, strict
UTF-8, json per line); never fewer, silently. Fixed seed, bounded examples (CI)."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_tools.readers import Fields, InputError, read_records

FORMATS = ["jsonl", "jsonl.gz", "jsonl.zst"]


def encode(texts: list[str], fmt: str) -> bytes:
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    if fmt == "jsonl.gz":
        return gzip.compress(raw, mtime=0)
    if fmt == "jsonl.zst":
        return zstandard.ZstdCompressor().compress(raw)
    return raw


def reference(data: bytes, fmt: str) -> list[str] | None:
    """The intact documents, or None if anything is damaged."""
    try:
        if fmt == "jsonl.gz":
            data = gzip.decompress(data)
        elif fmt == "jsonl.zst":
            data = zstandard.ZstdDecompressor().decompress(data)
        text = data.decode("utf-8")
    except (OSError, EOFError, zlib.error, zstandard.ZstdError, UnicodeDecodeError):
        return None
    docs = []
    for line in text.split("\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            return None
        docs.append(record["text"])
    return docs


damage = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1), st.just(0)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("property")


@settings(
    max_examples=400,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    texts=st.lists(st.text(max_size=30), min_size=1, max_size=8),
    fmt=st.sampled_from(FORMATS),
    how=damage,
)
def test_damage_fails_or_yields_exactly_the_intact_documents(workdir, texts, fmt, how):
    data = bytearray(encode(texts, fmt))
    kind, where, value = how
    position = min(int(where * len(data)), len(data) - 1)
    if kind == "truncate":
        data = data[:position]
    else:
        data[position] ^= value
    path = workdir / f"input.{fmt}"
    path.write_bytes(bytes(data))
    expected = reference(bytes(data), fmt)
    try:
        got = list(read_records(path, Fields()))
    except InputError as err:
        message = str(err)
        assert "\n" not in message and message.startswith(str(path)), message
        got = None
    assert got == expected, (fmt, how, got, expected)
