"""data-tools with damaged and unusual input: every case ends in one line naming the file
(and place) or the option, exit status 2, no traceback, and nothing is lost: the previous
build is intact, the user's files are intact, and what a build reports equals a count made
here independently."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
import zstandard

from data_tools.build import build_shards
from data_tools.cli import main as cli
from del_megatron.data import read_manifest

DOCS = [f"Invoice {i}: {i * 7}.{i % 100:02d} dollars for {i + 3} items." for i in range(60)]


def jsonl(docs=DOCS, field="text") -> bytes:
    return "".join(json.dumps({field: d}) + "\n" for d in docs).encode()


def snapshot(directory: Path) -> dict[str, str]:
    """Every file below `directory` with its SHA-256."""
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli([str(a) for a in argv])
    except SystemExit as exit_:  # argparse
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, expected: str) -> None:
    lines = [line for line in err.replace("\r", "\n").splitlines() if "error" in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert expected in lines[0], err


@pytest.fixture
def previous_build(tmp_path, synth_tokenizer):
    """An output directory holding a good build, and its snapshot."""
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl())
    out = tmp_path / "out"
    build_shards([good], out, synth_tokenizer, progress=False, workers=0)
    return out, snapshot(out)


def zst(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def damaged_inputs(tmp: Path) -> list[tuple[str, Path, str]]:
    """(case, file, what the one line must say besides the file's name)."""
    full = jsonl()
    cases = []

    def put(name: str, data: bytes, expected: str, case: str) -> None:
        path = tmp / name
        path.write_bytes(data)
        cases.append((case, path, expected))

    put("cut.jsonl.zst", zst(full)[: len(zst(full)) // 2], "truncated", "zst cut in half")
    put("end.jsonl.zst", zst(full)[:-3], "truncated", "zst cut near its end")
    # zstd can tell corruption only with the frame's checksum (the zstd tool writes one)
    corrupt = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(full))
    corrupt[len(corrupt) // 2 : len(corrupt) // 2 + 8] = b"\xff" * 8
    put("corrupt.jsonl.zst", bytes(corrupt), "corrupt compressed data", "zst corrupted")
    corrupt = bytearray(gzip.compress(full))
    corrupt[len(corrupt) // 2 : len(corrupt) // 2 + 8] = b"\xff" * 8
    put("corrupt.jsonl.gz", bytes(corrupt), "corrupt compressed data", "gz corrupted")
    put("cut.jsonl.gz", gzip.compress(full)[:-12], "truncated", "gz cut")
    put("cut.jsonl", full[:-10], "line 60", "jsonl cut inside the last record")
    put("utf8.jsonl", full[:50] + b"\xff\xfe" + full[50:], "not UTF-8 at byte 50", "invalid UTF-8")
    put("utf8.txt", b"12 apples\n\xff\n", "not UTF-8 at byte 10", "txt invalid UTF-8")
    put(
        "field.jsonl",
        jsonl(field="body"),
        "line 1 (byte 0): no field 'text' (have ['body']); choose it with --text-field NAME",
        "missing field",
    )
    put("array.jsonl", b"[1, 2]\n", "line 1 (byte 0): not a JSON object", "not an object")
    put("trailing.jsonl.zst", zst(full) + b"garbage", "corrupt compressed data", "zst + junk")
    return cases


def test_damaged_inputs_fail_naming_file_and_place_and_keep_the_previous_build(
    tmp_path, capsys, synth_tokenizer, previous_build
):
    out, before = previous_build
    good = tmp_path / "good.jsonl"
    for case, path, expected in damaged_inputs(tmp_path):
        code, _, err = run(capsys, "build", good, path, "-o", out, "--tokenizer", synth_tokenizer)
        assert code == 2, case
        one_error_line(err, f"{path}")
        one_error_line(err, expected)
        assert snapshot(out) == before, case  # the previous build, untouched
        assert not list(tmp_path.glob(".out.*")), case  # no staging, no lock


def test_skip_counts_what_it_leaves_out(tmp_path, capsys, synth_tokenizer):
    lines = jsonl().splitlines(keepends=True)
    lines[4] = b"{not json\n"
    lines[9] = b'{"body": "no text field"}\n'
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_bytes(b"".join(lines))
    cut = tmp_path / "cut.jsonl.zst"
    whole = zst(jsonl())
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    out = tmp_path / "out"
    code, stdout, err = run(
        capsys,
        "build",
        damaged,
        cut,
        "-o",
        out,
        "--tokenizer",
        synth_tokenizer,
        "--on-error",
        "skip",
        "--quiet",
    )
    assert code == 0, err
    manifest = read_manifest(str(out / "manifest.json"))
    damaged_entry, cut_entry = manifest.inputs
    assert (damaged_entry.documents, damaged_entry.skipped) == (58, 2)
    assert "line 5" in damaged_entry.damage[0] and "line 10" in damaged_entry.damage[1]
    # a cut stream gives what was decompressed before the cut: count it independently
    decoder = zstandard.ZstdDecompressor().decompressobj()
    text = decoder.decompress(cut.read_bytes())
    intact = sum(1 for line in text.split(b"\n")[:-1] if line.strip())
    assert (cut_entry.documents, cut_entry.skipped) == (intact, 1) and intact < 60
    assert "truncated" in cut_entry.damage[0]
    assert manifest.documents == 58 + intact
    assert damaged_entry.bytes == damaged.stat().st_size
    assert damaged_entry.sha256 == hashlib.sha256(damaged.read_bytes()).hexdigest()
    assert "skipped 2 damaged records of" in stdout and "skipped 1 damaged records of" in stdout


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda out: (out / "notes.txt").write_text("mine"), "notes.txt"),
        (lambda out: (out / "shard-00099.tar").write_bytes(b"x"), "shard-00099.tar"),
        (lambda out: (out / "x.tmp").write_bytes(b"x"), "x.tmp"),
        (lambda out: (out / "sub").mkdir(), "sub"),
    ],
    ids=["notes", "shard-like", "tmp-like", "directory"],
)
def test_files_that_are_not_ours_are_refused_then_kept_with_force(
    make, expected, tmp_path, capsys, synth_tokenizer, previous_build
):
    out, _ = previous_build
    make(out)
    before = snapshot(out)
    good = tmp_path / "good.jsonl"
    code, _, err = run(capsys, "build", good, "-o", out, "--tokenizer", synth_tokenizer, "--quiet")
    assert code == 2
    one_error_line(err, f"{out}: holds files this command did not write ({expected}")
    assert snapshot(out) == before
    code, _, err = run(
        capsys, "build", good, "-o", out, "--tokenizer", synth_tokenizer, "--quiet", "--force"
    )
    assert code == 0, err
    after = snapshot(out)
    for name, digest in before.items():
        if name.startswith(expected):
            assert after[name] == digest  # the user's file, kept
    assert read_manifest(str(out / "manifest.json")).documents == len(DOCS)


def test_directory_inputs_take_every_file_or_refuse(tmp_path, capsys, synth_tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(jsonl(DOCS[:20]))
    (corpus / "B.JSONL").write_bytes(jsonl(DOCS[20:50]))  # another case: still taken
    (corpus / ".hidden").write_text("editor state")
    out = tmp_path / "out"
    code, _, err = run(
        capsys, "build", corpus, "-o", out, "--tokenizer", synth_tokenizer, "--quiet"
    )
    assert code == 0, err
    assert read_manifest(str(out / "manifest.json")).documents == 50
    (corpus / "c.json").write_text('{"text": "a JSON file"}')
    code, _, err = run(
        capsys, "build", corpus, "-o", out, "--tokenizer", synth_tokenizer, "--quiet"
    )
    assert code == 2
    one_error_line(err, "c.json: unknown input format")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["synth", "-o", "{tmp}/s", "--documents", "-5"], "--documents: must be at least 1"),
        (["synth", "-o", "{tmp}/s", "--heldout", "-1"], "--heldout: must be 0 or more"),
        (
            ["build", "{good}", "-o", "{tmp}/o", "--tokenizer", "{tok}", "--shard-mb", "-1"],
            "--shard-mb: must be greater than 0",
        ),
        (
            ["build", "{good}", "-o", "{tmp}/o", "--tokenizer", "{tok}", "--workers", "-2"],
            "--workers: must be 0 or more",
        ),
        (
            ["tokenizer", "{good}", "-o", "{tmp}/t.model", "--vocab-size", "0"],
            "--vocab-size: must be at least 1",
        ),
        (["tokenizer", "{empty}", "-o", "{tmp}/t.model"], "no text to train on in"),
        (
            ["tokenizer", "{empty}", "-o", "{tmp}/t.json", "--style", "llama3"],
            "no text to train on in",
        ),
        (
            ["tokenizer", "{good}", "-o", "{tmp}/t.model", "--vocab-size", "20"],
            "cannot train a tokenizer: ",
        ),
        (["tokenizer", "{good}", "-o", "{good}/t.model"], "cannot write"),
        (["build", "{empty}", "-o", "{tmp}/o", "--tokenizer", "{tok}"], "no documents in"),
        (
            ["build", "{good}", "-o", "{good}", "--tokenizer", "{tok}"],
            "exists and is not a directory",
        ),
        (
            ["build", "{good}", "-o", "{good}/under/a/file", "--tokenizer", "{tok}"],
            "cannot write there",
        ),
        (
            ["build", "{tmp}/nope.jsonl", "-o", "{tmp}/o", "--tokenizer", "{tok}"],
            "nope.jsonl: no such file",
        ),
        (
            ["build", "{good}", "-o", "{tmp}/o", "--tokenizer", "{tmp}/missing.model"],
            "tokenizer not found",
        ),
        (
            ["build", "{good}", "-o", "{tmp}/o", "--tokenizer", "{tok}", "--prompt-field", "q"],
            "give both --prompt-field and --response-field",
        ),
        (
            ["build", "{good}", "-o", "{tmp}/o", "--tokenizer", "{tok}"]
            + ["--prompt-field", "txt", "--response-field", "answer"],
            "did you mean 'text'? choose it with --prompt-field/--response-field NAME",
        ),
        (
            ["build", "{parquet}", "-o", "{tmp}/o", "--tokenizer", "{tok}"],
            "no field 'text' (have ['body']); choose it with --text-field NAME",
        ),
        (
            ["build", "{cut_parquet}", "-o", "{tmp}/o", "--tokenizer", "{tok}"],
            "not a readable parquet file",
        ),
        (
            ["inspect", "{manifest}", "--tokenizer", "{other_tok}"],
            "is not the tokenizer these shards were built with",
        ),
        (["inspect", "{tmp}/nowhere/manifest.json"], "no such file"),
    ],
    ids=lambda v: v if isinstance(v, str) and not v.startswith(("synth", "build")) else None,
)
def test_command_mistakes_are_one_line(
    argv, expected, tmp_path, capsys, synth_tokenizer, spm_split_digits, synth_shards
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl())
    (tmp_path / "empty.jsonl").write_bytes(b"")
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "a.parquet")
    data = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    names = {
        "tmp": tmp_path,
        "good": good,
        "tok": synth_tokenizer,
        "other_tok": spm_split_digits,
        "empty": tmp_path / "empty.jsonl",
        "parquet": tmp_path / "a.parquet",
        "cut_parquet": tmp_path / "cut.parquet",
        "manifest": synth_shards,
    }
    before = snapshot(tmp_path)
    code, _, err = run(capsys, *(a.format(**names) for a in argv))
    assert code == 2
    if "must be" in expected:  # argparse's own usage error
        assert expected in err and "Traceback" not in err
    else:
        one_error_line(err, expected)
    assert snapshot(tmp_path) == before  # nothing written, nothing lost
