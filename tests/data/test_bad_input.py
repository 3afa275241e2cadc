"""python -m del_megatron.data with damaged manifests and shards: one line naming the file,
exit status 2 (or, with --on-error skip, the damaged shard left out and listed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from ..distributed.launcher import ROOT


def stream(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "del_megatron.data", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )


@pytest.fixture
def shards(tmp_path, synth_shards):
    copy = tmp_path / "shards"
    shutil.copytree(synth_shards.parent, copy)
    return copy / "manifest.json"


def test_help_says_the_default_is_to_fail():
    help_text = stream("--help").stdout.replace("\n", " ")
    assert "A corrupt shard stops the run" in help_text and "(fail, the default)" in help_text


def break_it(case: str, manifest):
    data = json.loads(manifest.read_text())
    first = manifest.parent / data["shards"][0]["name"]
    if case == "missing manifest":
        manifest.unlink()
    elif case == "manifest not JSON":
        manifest.write_text("[oops")
    elif case == "manifest from the future":
        manifest.write_text(json.dumps({**data, "version": 7}))
    elif case in ("corrupt shard", "corrupt shard skipped"):
        raw = bytearray(first.read_bytes())
        raw[600] ^= 0xFF
        first.write_bytes(bytes(raw))
    elif case == "truncated shard":
        first.write_bytes(first.read_bytes()[:1024])
    return first


@pytest.mark.parametrize(
    ("case", "options", "expected"),
    [
        ("missing manifest", [], "manifest.json: no such file"),
        ("manifest not JSON", [], "not a shard manifest"),
        ("manifest from the future", [], "manifest version 7 is newer"),
        ("corrupt shard", [], "checksum differs from the manifest (corrupted)"),
        ("truncated shard", [], "bytes, manifest says"),
        ("zero sequence length", ["--seq-len", "0"], "--seq-len: must be at least 1"),
    ],
)
def test_mistakes_are_one_line(case, options, expected, shards):
    broken = break_it(case, shards)
    proc = stream(shards, *options)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and expected in proc.stderr, proc.stderr
    if not options:
        assert proc.stderr.count("\n") == 1
        name = shards.name if "manifest" in case else broken.name
        assert name in proc.stderr


def test_skip_leaves_the_corrupt_shard_out_and_lists_it(shards):
    broken = break_it("corrupt shard skipped", shards)
    proc = stream(shards, "--on-error", "skip", "--seq-len", "64")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["skipped_shards"]) == 1 and broken.name in report["skipped_shards"][0]
