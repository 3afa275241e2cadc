"""data_tools build: formats, round trip through the loader, determinism, tar layout, kills."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from data_tools.build import build_shards
from data_tools.readers import Fields
from del_megatron.data import DataConfig, DataSource, StreamingLoader, read_manifest
from del_megatron.data.format import read_shard, resolve
from del_megatron.tokenizer import Tokenizer

from ..data.streams import stream_of

TEXTS = [
    "The price rose from 12.50 to 13.75 dollars, a gain of 10%.",
    "In 2026-11-29 there were 1,000 visitors and .5 of them came twice.",
    "Plain prose without any digit at all.",
    "x = 3.14159 * 2 = 6.28318",
] * 5


def _write_inputs(directory: Path, texts: list[str]) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    directory.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"body": t}) + "\n" for t in texts).encode()
    paths = {
        "jsonl": directory / "a.jsonl",
        "jsonl.gz": directory / "a.jsonl.gz",
        "jsonl.zst": directory / "a.jsonl.zst",
        "parquet": directory / "a.parquet",
    }
    paths["jsonl"].write_bytes(lines)
    paths["jsonl.gz"].write_bytes(gzip.compress(lines))
    paths["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.table({"body": texts}), paths["parquet"])
    return paths


def _expected_stream(texts, tokenizer: Tokenizer) -> np.ndarray:
    return np.concatenate([np.array(tokenizer.encode(t) + [tokenizer.eos_id]) for t in texts])


def _read_back(manifest: Path, seq_len: int = 16) -> tuple[np.ndarray, np.ndarray]:
    cfg = DataConfig(
        sources=[DataSource(manifest=str(manifest))],
        seq_len=seq_len,
        micro_batch_size=3,
        shuffle=False,
        epochs=1,
    )
    return stream_of(StreamingLoader(cfg))


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_round_trip_reproduces_the_token_stream(fmt, tmp_path, synth_tokenizer):
    inputs = _write_inputs(tmp_path / "in", TEXTS)
    manifest = build_shards(
        [inputs[fmt]],
        tmp_path / "out",
        synth_tokenizer,
        fields=Fields(text="body"),
        shard_bytes=2048,
        progress=False,
    )
    assert len(manifest.shards) > 1 and manifest.documents == len(TEXTS)
    expected = _expected_stream(TEXTS, Tokenizer(synth_tokenizer))
    tokens, mask = _read_back(tmp_path / "out" / "manifest.json")
    assert np.array_equal(tokens[: len(expected)], expected)
    assert (mask[len(expected) :] == 0).all()  # the rest is padding
    assert mask[1 : len(expected)].all()


def test_gsm8k_as_instruction_data_masks_the_questions(gsm8k_train, tmp_path, synth_tokenizer):
    head = tmp_path / "gsm8k-head.jsonl"
    records = [json.loads(line) for line in gsm8k_train.read_text().splitlines()[:200]]
    head.write_text("".join(json.dumps(r) + "\n" for r in records))
    build_shards(
        [head],
        tmp_path / "out",
        synth_tokenizer,
        progress=False,
        fields=Fields(prompt="question", response="answer"),
    )
    tok = Tokenizer(synth_tokenizer)
    tokens, mask = _read_back(tmp_path / "out" / "manifest.json", seq_len=256)
    position = 0
    for record in records:
        question, answer = tok.encode(record["question"]), tok.encode(record["answer"])
        n = len(question) + len(answer)
        assert tokens[position : position + n].tolist() == question + answer
        # a target is trained iff it belongs to the answer (or is the EOS after it)
        assert not mask[position + 1 : position + len(question)].any()
        assert mask[position + len(question) : position + n + 1].all()
        position += n + 1


def test_identical_input_gives_identical_bytes(tmp_path, synth_corpus, synth_tokenizer):
    a = build_shards(
        [synth_corpus / "train.jsonl"],
        tmp_path / "a",
        synth_tokenizer,
        shard_bytes=32 << 10,
        workers=2,
        progress=False,
    )
    b = build_shards(
        [synth_corpus / "train.jsonl"],
        tmp_path / "b",
        synth_tokenizer,
        shard_bytes=32 << 10,
        workers=1,
        progress=False,
    )
    assert a == b
    for entry in a.shards:
        assert (tmp_path / "a" / entry.name).read_bytes() == (
            tmp_path / "b" / entry.name
        ).read_bytes()
    assert (tmp_path / "a/manifest.json").read_bytes() == (
        tmp_path / "b/manifest.json"
    ).read_bytes()


def test_shards_are_plain_ustar_without_pax_headers(synth_shards):
    manifest = read_manifest(str(synth_shards))
    path = synth_shards.parent / manifest.shards[0].name
    with tarfile.open(path) as tar:
        members = tar.getmembers()
        assert members and all(m.pax_headers == {} for m in members)
        assert {m.name.rsplit(".", 1)[1] for m in members} == {"tokens"}
        assert all(m.mtime == 0 for m in members)
    raw = path.read_bytes()
    typeflags = {
        raw[offset + 156 : offset + 157]
        for offset in range(0, len(raw) - 512, 512)
        if raw[offset + 257 : offset + 262] == b"ustar"
    }
    assert b"x" not in typeflags and b"g" not in typeflags  # no PAX records


def test_manifest_counts_and_checksums_match(synth_shards, synth_tokenizer):
    manifest = read_manifest(str(synth_shards))
    assert manifest.tokenizer.fingerprint == Tokenizer(synth_tokenizer).fingerprint
    documents = sum(
        len(read_shard(resolve(str(synth_shards), e.name), e, allow_pipe=False))
        for e in manifest.shards
    )
    assert documents == manifest.documents == 600


@pytest.mark.slow
def test_killed_rebuild_leaves_the_previous_build_and_a_rerun_replaces_it(
    tmp_path, synth_tokenizer, synth_corpus
):
    from data_tools.synth import write_corpus

    out = tmp_path / "out"
    build_shards([synth_corpus / "heldout.jsonl"], out, synth_tokenizer, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write_corpus(tmp_path / "corpus", documents=20000, heldout=1, seed=3)
    cmd = [
        sys.executable,
        "-m",
        "data_tools",
        "build",
        str(tmp_path / "corpus" / "train.jsonl"),
        "-o",
        str(out),
        "--tokenizer",
        str(synth_tokenizer),
        "--shard-mb",
        "0.05",
        "--quiet",
    ]
    for wait_for in ("shard-00002.tar", "shard-00010.tar"):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while not list(tmp_path.glob(f".out.partial-*/{wait_for}")) and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched
    assert subprocess.run(cmd, check=False).returncode == 0
    manifest = read_manifest(str(out / "manifest.json"))
    for entry in manifest.shards:
        read_shard(str(out / entry.name), entry, allow_pipe=False)
    assert manifest.documents == 20000
    [aside] = out.glob("previous-*")  # the first build, set aside whole
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    assert sorted(p.name for p in out.iterdir() if p != aside) == sorted(
        ["manifest.json", *(e.name for e in manifest.shards)]
    )
    assert not list(tmp_path.glob(".out.*"))  # the killed builds' staging and lock: gone


def test_inspect_shows_a_decoded_sample_with_its_prompt_apart(tmp_path, synth_tokenizer, capsys):
    """Given the directory `build` printed, with no --tokenizer: the manifest's tokenizer is
    found beside the shards (as the quick start lays them out), digit statistics are shown,
    and the first document decoded, its prompt (not trained on) apart."""
    from data_tools.cli import main

    run = tmp_path / "run"
    (run / "shards").mkdir(parents=True)
    tokenizer = run / "tokenizer.model"
    tokenizer.write_bytes(synth_tokenizer.read_bytes())
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "What is 12 + 30?\n", "answer": "It is 42."}) + "\n")
    args = ["--tokenizer", str(tokenizer), "--prompt-field", "question", "--response-field"]
    args.append("answer")
    assert main(["build", str(qa), "-o", str(run / "shards" / "qa"), *args, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(run / "shards" / "qa")]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tokenizer_file"] == str(tokenizer.resolve())
    assert stats["digit_tokens"] == 6  # 1 2 3 0 4 2
    assert stats["samples"] == [
        {"prompt (not trained on)": "What is 12 + 30?\n", "trained": "It is 42."}
    ]
