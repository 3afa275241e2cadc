"""Faults a cluster user meets with data-tools build: two builds into one output at once
(real processes), a full disk, symlinked corpora. Each ends in one line and exit status 2
or is survived, and the previous good build is never lost."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_tools.build import build_shards
from del_megatron.data import read_manifest
from del_megatron.data.format import read_shard

from .test_bad_input import DOCS, jsonl, one_error_line, run, snapshot


def build_cmd(corpus: Path, out: Path, tokenizer: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "data_tools",
        "build",
        str(corpus),
        "-o",
        str(out),
        "--tokenizer",
        str(tokenizer),
        "--shard-mb",
        "0.05",
        "--quiet",
        "--workers",
        "0",
        *extra,
    ]


def wait_for_shards(parent: Path, name: str, count: int, proc: subprocess.Popen) -> None:
    """Until the writer of `parent/name` has `count` shards in its staging directory."""
    deadline = time.time() + 120
    while len(list(parent.glob(f".{name}.partial-*/shard-*.tar"))) < count:
        assert proc.poll() is None, "the first build ended before the second started"
        assert time.time() < deadline
        time.sleep(0.01)


def start_and_stop_midway(cmd: list[str], parent: Path) -> subprocess.Popen:
    """A build of `cmd` (into `parent/out`) started, then stopped (SIGSTOP) once it has
    written 2 shards: it holds the output's lock until SIGCONT."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_shards(parent, "out", 2, proc)
    proc.send_signal(signal.SIGSTOP)
    return proc


def assert_whole(out: Path, documents: int) -> None:
    """`out` holds one complete build: the manifest lists exactly the shards there, each
    matching its checksum."""
    manifest = read_manifest(str(out / "manifest.json"))
    for entry in manifest.shards:
        read_shard(str(out / entry.name), entry, allow_pipe=False)
    here = [p.name for p in out.iterdir() if not p.name.startswith("previous-")]  # set aside
    assert sorted(here) == sorted(["manifest.json", *(e.name for e in manifest.shards)])
    assert manifest.documents == documents


@pytest.mark.slow
def test_a_second_build_into_the_same_output_is_refused_or_waits(
    tmp_path, synth_tokenizer, synth_corpus
):
    """A rerun while the first build still writes: refused naming the first's host and pid
    (the first completes, the earlier good build replaced whole), or with --wait-for-lock
    run after it. Before the lock both used one staging directory: the first committed a
    manifest that did not match its shards, the second died with 'No such file', and the
    earlier build was gone."""
    from data_tools.synth import write_corpus

    out = tmp_path / "out"
    build_shards([synth_corpus / "heldout.jsonl"], out, synth_tokenizer, progress=False)
    write_corpus(tmp_path / "corpus", documents=15000, heldout=1, seed=3)
    corpus = tmp_path / "corpus" / "train.jsonl"
    cmd = build_cmd(corpus, out, synth_tokenizer)

    # The first is stopped while the second runs: it holds its lock and its staging
    # directory, and a loaded machine cannot let it finish before the second starts.
    first = start_and_stop_midway(cmd, tmp_path)
    try:
        second = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, stderr = second.communicate(timeout=300)
        assert not list(tmp_path.glob(f".out.partial-*-{second.pid}"))  # it wrote nothing
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2, stderr
    one_error_line(stderr, f"host {socket.gethostname()}, pid {first.pid}")
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert_whole(out, 15000)

    # the same again, the second asked to wait: both complete, one after the other
    first = start_and_stop_midway(cmd, tmp_path)
    try:
        waiting = subprocess.Popen(
            [*cmd, "--wait-for-lock"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        said = waiting.stderr.readline()  # it says whom it waits for, then waits
    finally:
        first.send_signal(signal.SIGCONT)
    holder = f"host {socket.gethostname()}, pid {first.pid}"
    assert f"waiting for the process writing it ({holder}" in said, said
    assert first.wait(timeout=300) == 0, first.stderr.read()
    _, stderr = waiting.communicate(timeout=300)
    assert waiting.returncode == 0, said + stderr
    assert_whole(out, 15000)
    assert not list(tmp_path.glob(".out.*"))  # no staging, no lock left


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path, capsys, synth_tokenizer):
    """A build killed with SIGKILL leaves its lock: a pid of this host that is gone is
    detected and the lock taken over; one of another host is reported, never taken."""
    from del_megatron.outputs import lock_of

    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl())
    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    lock_of(out).write_text(f'{{"host": "{host}", "pid": {dead.pid}, "since": 0}}')
    code, _, err = run(capsys, "build", good, "-o", out, "--tokenizer", synth_tokenizer)
    assert code == 0, err
    lock_of(out).write_text('{"host": "node-elsewhere", "pid": 1, "since": 0}')
    code, _, err = run(capsys, "build", good, "-o", out, "--tokenizer", synth_tokenizer)
    assert code == 2
    one_error_line(err, "being written by another process (host node-elsewhere, pid 1)")
    assert lock_of(out).exists()  # not ours to remove
    assert read_manifest(str(out / "manifest.json")).documents == len(DOCS)


def test_a_full_disk_is_one_line_and_the_previous_build_stays(
    tmpfs, tmp_path, capsys, synth_tokenizer, synth_corpus
):
    small_disk = tmpfs("256k")
    out = small_disk / "out"
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl())
    build_shards([good], out, synth_tokenizer, progress=False, workers=0)
    before = snapshot(out)
    code, _, err = run(
        capsys, "build", synth_corpus / "train.jsonl", "-o", out, "--tokenizer", synth_tokenizer
    )
    assert code == 2
    one_error_line(err, f"{out}: no space left on the device")
    assert snapshot(out) == before
    assert not list(small_disk.glob(".out.*"))


def test_symlinked_corpora_are_read_whole_or_refused(tmp_path, capsys, synth_tokenizer):
    """A linked subdirectory and a linked file are read (before: left out, exit 0), a loop
    is read once with a line, a dangling link and a fifo are refused naming them."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.jsonl").write_bytes(jsonl(DOCS[20:50]))
    (tmp_path / "c.jsonl").write_bytes(jsonl(DOCS[50:]))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(jsonl(DOCS[:20]))
    (corpus / "linked").symlink_to(elsewhere)
    (corpus / "c.jsonl").symlink_to(tmp_path / "c.jsonl")
    (elsewhere / "loop").symlink_to(corpus)  # corpus/linked/loop -> corpus
    out = tmp_path / "out"
    argv = ("build", corpus, "-o", out, "--tokenizer", synth_tokenizer, "--quiet")
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    manifest = read_manifest(str(out / "manifest.json"))
    assert manifest.documents == len(DOCS)
    assert sorted(Path(e.name).name for e in manifest.inputs) == ["a.jsonl", "b.jsonl", "c.jsonl"]
    assert f"{corpus}/linked/loop is {corpus} again (a symbolic link): read once" in err

    (corpus / "gone.jsonl").symlink_to(tmp_path / "deleted.jsonl")
    code, _, err = run(capsys, *argv)
    assert code == 2
    one_error_line(err, f"{corpus}/gone.jsonl: a symbolic link to {tmp_path}/deleted.jsonl")
    (corpus / "gone.jsonl").unlink()
    os.mkfifo(corpus / "pipe.jsonl")
    code, _, err = run(capsys, *argv)
    assert code == 2
    one_error_line(err, f"{corpus}/pipe.jsonl: not a file or directory")
