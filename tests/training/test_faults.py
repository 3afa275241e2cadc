"""Faults a cluster user meets with del-train, with real processes: a second job into a
running job's output_dir, a full disk during a checkpoint save, one changed byte in the
saved optimizer state. Each ends in one line and exit status 2 on every rank; nothing of
the earlier run is lost."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ..distributed.launcher import ROOT, torchrun_command, torchrun_env
from .test_resume import train_args as resume_args

pytestmark = pytest.mark.slow


def train_args(out: Path, tokenizer, manifest, *extra: str) -> list[str]:
    """test_resume's run, at tensor parallel 1 on 8 sequences a step, a line a step."""
    return resume_args(
        out, tokenizer, manifest, "train.global_batch_size=8", "train.log_interval=1", *extra, tp=1
    )


def one_process(out: Path, tokenizer, manifest, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "del_megatron.cli.train",
        *train_args(out, tokenizer, manifest, *extra),
    ]


def two_ranks(out: Path, tokenizer, manifest, *extra: str) -> list[str]:
    """Data parallel 2: the same 8 sequences a step, 4 a rank."""
    args = train_args(out, tokenizer, manifest, "train.micro_batch_size=4", *extra)
    return torchrun_command("-m del_megatron.cli.train", 2, *args)


def run(cmd, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        env={**torchrun_env(), **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        check=False,
    )


# far more steps than either job can train before the test ends (a slow start of the second
# job must still find the first running)
LONG_RUN = "train.steps=100000"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("del-train: error")]


def user_errors(directory: Path) -> dict[str, str]:
    """The one line each rank left for the launcher (DEL_USER_ERROR_DIR)."""
    return {p.name: p.read_text().strip() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, synth_tokenizer, synth_shards):
    """A real checkpoint of 2 steps at ZeRO 1 on one process (step-0000002)."""
    out = tmp_path_factory.mktemp("faults") / "run"
    done = run(one_process(out, synth_tokenizer, synth_shards, "train.steps=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_a_changed_byte_of_a_master_weight_is_refused_at_another_layout(
    saved, tmp_path, synth_tokenizer, synth_shards
):
    """Before: one byte of a master weight in optim/*.safetensors changed, the resume at
    another layout (ZeRO 2) trained on the changed value and exited 0."""
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    state = out / "checkpoints" / "step-0000002" / "optim" / "tp00-dp00.safetensors"
    data = bytearray(state.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header + 4 * 1000 + 2] ^= 0x01  # inside the first tensor's fp32 master weight
    state.write_bytes(bytes(data))
    cmd = one_process(out, synth_tokenizer, synth_shards, "train.steps=3", "parallel.zero_stage=2")
    done = run([*cmd, "--resume", "auto"])
    assert done.returncode == 2, done.stderr[-3000:]
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{state}: its contents differ from the checksum" in lines[0]
    assert not (out / "checkpoints" / "step-0000003").exists()


def test_a_second_job_into_a_running_jobs_output_is_refused_on_every_rank(
    saved, tmp_path, synth_tokenizer, synth_shards
):
    """A job running in output_dir, a second (2 ranks) started into it: both its ranks stop
    with the first job's host and pid (agreed), the first runs on. Before: the second
    removed the first's partial checkpoint and both wrote the same checkpoints."""
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    first = subprocess.Popen(
        [*one_process(out, synth_tokenizer, synth_shards, LONG_RUN), "--resume", "auto"],
        env=torchrun_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        metrics = out / "metrics.jsonl"
        while not any(json.loads(line)["step"] > 2 for line in metrics.read_text().splitlines()):
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            assert time.time() < deadline
            time.sleep(0.1)
        errors = tmp_path / "errors"
        errors.mkdir()
        second = run(
            [
                *two_ranks(
                    out,
                    synth_tokenizer,
                    synth_shards,
                    LONG_RUN,
                ),
                "--resume",
                "auto",
            ],
            DEL_USER_ERROR_DIR=str(errors),
        )
        assert second.returncode != 0, second.stderr[-3000:] + second.stdout[-2000:]
        expected = (
            f"being written by another process (host {socket.gethostname()}, pid {first.pid})"
        )
        left = user_errors(errors)
        assert sorted(left) == ["rank-0", "rank-1"], second.stderr[-3000:]
        assert all(expected in line for line in left.values()), left
        assert "del_megatron/" not in second.stderr, second.stderr[-3000:]  # no frame of ours
        assert first.poll() is None  # the first job runs on
    finally:
        for p in [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]:
            p.send_signal(signal.SIGKILL)
        first.wait()


def test_a_full_disk_at_a_checkpoint_is_one_line_on_every_rank(
    tmpfs, synth_tokenizer, synth_shards
):
    """A checkpoint the disk has no room for: refused before the save writes a byte, on
    both ranks, naming the directory and the bytes needed (before: exit 1 and thousands of
    lines of tracebacks); and a disk that fills during the save anyway: one line too."""
    small = tmpfs("2m")
    errors = small.parent / "errors"
    errors.mkdir()
    cmd = two_ranks(small / "run", synth_tokenizer, synth_shards, "train.steps=2")
    done = run(cmd, DEL_USER_ERROR_DIR=str(errors))
    assert done.returncode != 0
    left = user_errors(errors)
    assert sorted(left) == ["rank-0", "rank-1"], done.stderr[-3000:]
    checkpoints = small / "run" / "checkpoints"
    for line in left.values():
        assert f"{checkpoints}: no space left on the device (" in line, line
        assert " needed)" in line, line
    assert "del_megatron/" not in done.stderr, done.stderr[-3000:]  # no traceback of ours
    assert len(done.stderr.splitlines()) < 60, done.stderr[-3000:]  # torchrun's report aside

    # room for the estimate (the refusal above names it: weights and 12 bytes a parameter
    # of optimizer state, a lower bound), not for the checkpoint's other files too (its
    # tokenizer, RNG and JSON files, headers: ~50 kB here, and tmpfs's 4 kB blocks)
    needed = int(left["rank-0"].split(" bytes free, ")[1].split(" needed")[0])
    fills = tmpfs(f"{needed // 1024 + 32}k")
    done = run(one_process(fills / "run", synth_tokenizer, synth_shards, "train.steps=2"))
    assert done.returncode == 2, done.stderr[-3000:]
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{fills / 'run' / 'checkpoints'}: no space left on the device" in lines[0]
    assert not list((fills / "run" / "checkpoints").glob("step-*"))


def test_a_changed_byte_of_a_saved_weight_is_refused_by_its_readers(saved, tmp_path, capsys):
    """del-convert and del-eval read a checkpoint's model/ whole: verified against
    files.json (before: exported and evaluated the changed weights)."""
    from del_megatron.cli.convert import main as convert
    from del_megatron.cli.eval import main as evaluate

    checkpoint = tmp_path / "step"
    shutil.copytree(saved / "checkpoints" / "step-0000002", checkpoint)
    weights = checkpoint / "model" / "tp00.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    argv = ["megatron-to-hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]
    assert convert(argv) == 2
    err = capsys.readouterr().err
    assert f"{weights}: its contents differ from the checksum" in err and err.count("\n") == 1
    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert evaluate([str(checkpoint), "--gsm8k", str(problems), "--shots", "0"]) == 2
    assert f"{weights}: its contents differ from the checksum" in capsys.readouterr().err


def test_inputs_that_are_not_whole_are_refused_by_every_reader(saved, tmp_path, capsys):
    """Inputs that are not whole (issue 37): a checkpoint still being written (a `.tmp-`
    name, no files.json yet), a file of it missing, a step that does not exist. Before:
    del-eval and del-convert evaluated and exported the first (exit 0), and the missing step
    was 'model/arch.json: no such file (not a del-megatron weights directory)'."""
    from del_megatron.cli.convert import main as convert
    from del_megatron.cli.eval import main as evaluate

    root = tmp_path / "checkpoints"
    writing = root / ".tmp-step-0000004"
    shutil.copytree(saved / "checkpoints" / "step-0000002", writing)
    (writing / "files.json").unlink()
    unlisted = shutil.copytree(writing, root / "step-0000003")
    short = shutil.copytree(saved / "checkpoints" / "step-0000002", root / "step-0000002")
    (short / "model" / "arch.json").unlink()
    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    capsys.readouterr()
    cases = [
        (writing, "a directory still being written"),
        (unlisted, "no files.json (the list of its files"),
        (short, f"{short / 'model' / 'arch.json'}: missing (listed in"),
        (root / "step-0000040", f"does not exist ({root} holds step-0000002, step-0000003)"),
    ]
    for path, expected in cases:
        argv = ["megatron-to-hf", "--checkpoint", str(path), "--out", str(tmp_path / "hf")]
        assert convert(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
        assert evaluate([str(path), "--gsm8k", str(problems), "--shots", "0"]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists()
