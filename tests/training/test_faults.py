"""Faults a cluster user meets with del-train, with real processes: a second job into a
running job's output_dir, a full disk during a checkpoint save, one changed byte in the
saved optimizer state. Each ends in one line and exit status 2 on every rank; nothing of
the earlier run is lost."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from ..distributed.launcher import ROOT, WORKERS, free_port, torchrun_command, torchrun_env
from ..utils import logged_steps
from .test_resume import train_args as resume_args

pytestmark = pytest.mark.slow


def train_args(out: Path, tokenizer, manifest, *extra: str) -> list[str]:
    """test_resume's run, at tensor parallel 1 on 8 sequences a step, a line a step."""
    return resume_args(
        out, tokenizer, manifest, "train.global_batch_size=8", "train.log_interval=1", *extra, tp=1
    )


def one_process(
    out: Path, tokenizer, manifest, *extra: str, worker: str | None = None
) -> list[str]:
    """del-train, or tests/distributed/workers/<worker> given del-train's arguments."""
    target = [str(WORKERS / worker)] if worker else ["-m", "del_megatron.cli.train"]
    return [sys.executable, *target, *train_args(out, tokenizer, manifest, *extra)]


def two_ranks(out: Path, tokenizer, manifest, *extra: str, worker: str | None = None) -> list[str]:
    """Data parallel 2: the same 8 sequences a step, 4 a rank."""
    args = train_args(out, tokenizer, manifest, "train.micro_batch_size=4", *extra)
    return torchrun_command(worker or "-m del_megatron.cli.train", 2, *args)


# del-train, then the groups its process kept (workers/train_then_groups.py): a gloo group
# alive as the interpreter ends can turn the exit status into SIGABRT, now and then
THEN_GROUPS = "train_then_groups.py"
NO_GROUPS_LEFT = "groups after del-train: none"


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
    done = run(one_process(out, synth_tokenizer, synth_shards, "train.steps=2", worker=THEN_GROUPS))
    assert done.returncode == 0, done.stderr[-3000:]
    assert NO_GROUPS_LEFT in done.stdout, done.stdout[-2000:]  # a run that ended
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
        while not any(step > 2 for step in logged_steps(metrics)):
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            assert time.time() < deadline
            time.sleep(0.1)
        errors = tmp_path / "errors"
        errors.mkdir()
        second = run(
            [
                *two_ranks(out, synth_tokenizer, synth_shards, LONG_RUN, worker=THEN_GROUPS),
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
        # the refusal came after the groups were made: they are ended on every rank too
        assert second.stdout.count(NO_GROUPS_LEFT) == 2, second.stdout[-2000:]
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


def wait_for(
    predicate, what: str, proc: subprocess.Popen, timeout: float = 300, log: Path | None = None
) -> None:
    """Until `predicate()`; fails naming `what` (and the end of `log`, the run's stderr)."""
    deadline = time.time() + timeout
    while not predicate():
        tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
        assert proc.poll() is None, f"{what}: the run ended ({proc.returncode})\n{tail}"
        assert time.time() < deadline, f"{what} did not happen in {timeout:.0f} s\n{tail}"
        time.sleep(0.05)


def test_a_rank_whose_peers_never_come_says_so_stops_on_sigterm_and_gives_up(
    tmp_path, synth_tokenizer, synth_shards
):
    """Peers that never come (issue 37). Rank 0 of 2 started alone says within seconds what
    it waits for, and again later; a SIGTERM while it waits ends it in one line (75: nothing
    trained, the same command starts again). Rank 1 alone says it waits for rank 0's
    rendezvous and gives up after parallel.collective_timeout_minutes in one line (2).
    Before: 'building the model ... on 2 rank(s)', then nothing for 14 minutes, and the TERM
    did nothing (the TCPStore retried for an hour)."""
    cmd = one_process(tmp_path / "run", synth_tokenizer, synth_shards, "train.micro_batch_size=4")

    def as_rank(rank: int, port: int) -> dict[str, str]:
        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        return {**torchrun_env(), **ranks, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    port, stderr = free_port(), tmp_path / "rank0.err"
    with open(stderr, "w") as sink:
        alone = subprocess.Popen(
            cmd, env=as_rank(0, port), stdout=subprocess.DEVNULL, stderr=sink, cwd=ROOT
        )
    try:
        other = free_port()
        done = subprocess.run(
            [*cmd, "parallel.collective_timeout_minutes=0.1"],  # 6 s
            env=as_rank(1, other),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
            check=False,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        where = f"127.0.0.1:{other}"
        assert f"del-train: rank 1 of 2 waiting for rank 0's rendezvous at {where}" in lines[0]
        assert lines[-1].startswith(f"del-train: error: rank 1 of 2: no rendezvous at {where}")
        assert "within 6 s (parallel.collective_timeout_minutes)" in lines[-1], lines[-1]
        waiting = f"del-train: rank 0 waiting for 1 of 2 rank(s) to join at 127.0.0.1:{port}"

        def said_twice() -> bool:
            return stderr.read_text().count(waiting) >= 2  # at 3 s, then at 9 s

        wait_for(said_twice, "rank 0's lines about its wait", alone)
        assert "(missing: rank 1; not started, or not reaching it)" in stderr.read_text()
        alone.send_signal(signal.SIGTERM)
        assert alone.wait(timeout=60) == 75
        last = stderr.read_text().strip().splitlines()[-1]
        assert last.startswith("del-train: stopped by SIGTERM while rank 0 of 2 waited"), last
        assert "Traceback" not in stderr.read_text()
    finally:
        alone.kill()
        alone.wait()


def keep_full(directory: Path, proc: subprocess.Popen) -> threading.Thread:
    """Another writer that takes every byte of `directory`'s filesystem and every byte freed
    on it later, until `proc` ends."""

    def fill() -> None:
        handle = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while proc.poll() is None:
                try:
                    os.write(handle, bytes(4096))
                except OSError:
                    time.sleep(0.001)
        finally:
            os.close(handle)

    thread = threading.Thread(target=fill, daemon=True)
    thread.start()
    return thread


def test_a_disk_that_fills_under_a_background_save_ends_in_one_line(
    tmpfs, synth_tokenizer, synth_shards
):
    """The way out writes to the full disk (issue 37): a disk that another writer fills
    from the moment a checkpoint is being written behind training, and keeps full (wandb
    offline logging to the same disk), ends in the one line naming it, exit 2. Before: that
    line, then wandb's log handler's flush on the full disk raised while the error was
    handled: exit 1, 112 lines of stderr and 6 tracebacks."""
    disk = tmpfs("40m")
    out = disk / "run"
    extra = ("train.steps=8", "train.save_interval=1", "logging.wandb=offline")
    proc = subprocess.Popen(
        one_process(out, synth_tokenizer, synth_shards, *extra),
        env=torchrun_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    wait_for(lambda: any((out / "checkpoints").glob(".tmp-step-*")), "a background save", proc)
    filler = keep_full(disk, proc)  # from the first save on: it fails, or the next one does
    _, stderr = proc.communicate(timeout=300)
    filler.join()
    assert proc.returncode == 2, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1 and f"{out / 'checkpoints'}: no space left on the device" in lines[0]
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr[-3000:]


KILLED_BUILD = """
import sys, time
from pathlib import Path
from del_megatron import locks
assert locks.try_take(Path(sys.argv[1]), "a build") is None
print("held", flush=True)
time.sleep(120)
"""


def test_ctrl_c_stops_like_sigterm_and_the_same_command_continues(
    tmp_path, synth_tokenizer, synth_shards
):
    """The terminal (issue 37). Ctrl-C (SIGINT to the run's process group, as a terminal
    sends it) stops a one-process run as SIGTERM does: a checkpoint of the step trained, one
    line, exit 75. The same command then continues from it, and a second Ctrl-C exits at
    once (130) without a traceback. That second start also finds HOME not writable (the
    caches go elsewhere, said once) and the lock of an extension build killed midway in its
    way (what a dead process leaves behind: taken over, said once). Before: Ctrl-C printed
    tracebacks (exit 130) and kept nothing; the same command was refused (resume none);
    an unwritable HOME ended in a traceback of DeepSpeed's build; the lock hung the start."""
    from torch.utils.cpp_extension import _get_build_directory

    out = tmp_path / "run"
    cmd = one_process(out, synth_tokenizer, synth_shards, LONG_RUN)
    metrics = out / "metrics.jsonl"

    def steps() -> int:
        return len(logged_steps(metrics))

    def start(env: dict[str, str], stderr: Path) -> subprocess.Popen:
        with open(stderr, "w") as sink:
            return subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
                cwd=ROOT,
                start_new_session=True,  # a terminal's job: its own process group
            )

    first = start(torchrun_env(), tmp_path / "first.err")
    wait_for(lambda: steps() >= 2, "two steps", first, log=tmp_path / "first.err")
    os.killpg(first.pid, signal.SIGINT)
    stdout, _ = first.communicate(timeout=300)
    err = (tmp_path / "first.err").read_text()
    assert first.returncode == 75, err[-3000:]
    assert "Traceback" not in err and err.count("interrupted (Ctrl-C): stopping after") == 1, err
    (saved,) = sorted((out / "checkpoints").glob("step-*"))
    stopped = json.loads((saved / "meta.json").read_text())["step"]
    assert f"stop requested: checkpoint of step {stopped} saved" in stdout, (stdout[-2000:], err)

    # a copy of the built extension of our own: a lock left in the shared cache would be any
    # other process's to take over too (another test worker's rank loading the same op)
    shared = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    build = tmp_path / "torch_extensions" / shared.name
    shutil.copytree(shared, build, ignore=shutil.ignore_patterns("lock"))
    lock = build / "lock"
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_BUILD, str(lock)],
        stdout=subprocess.PIPE,
        text=True,
        env=torchrun_env(),
    )
    assert killed.stdout.readline().strip() == "held"
    killed.kill()  # the build killed midway: its lock stays
    killed.wait()
    (tmp_path / "a-file").write_text("")
    env = {**torchrun_env(), "HOME": str(tmp_path / "a-file" / "home")}
    env["TORCH_EXTENSIONS_DIR"] = str(build.parent)  # the build the lock is in, as before
    second = start(env, tmp_path / "second.err")
    try:
        wait_for(
            lambda: steps() > stopped,
            "a step after the resume",
            second,
            log=tmp_path / "second.err",
        )
        os.killpg(second.pid, signal.SIGINT)
        said = "interrupted (Ctrl-C)"
        wait_for(
            lambda: said in (tmp_path / "second.err").read_text(),
            "the first line",
            second,
            log=tmp_path / "second.err",
        )
        os.killpg(second.pid, signal.SIGINT)
        code = second.wait(timeout=60)
        assert code == 130, (code, (tmp_path / "second.err").read_text()[-3000:])
    finally:
        with contextlib.suppress(ProcessLookupError):  # its data worker, if it outlived it
            os.killpg(second.pid, signal.SIGKILL)
        second.wait()
    err = (tmp_path / "second.err").read_text()
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "del-train: interrupted again: exiting now (the last complete checkpoint is kept)"
    ), err[-3000:]
    said_out = second.stdout.read()
    assert f"resumed from {saved} at step {stopped}" in said_out, (said_out[-2000:], err[-2000:])
    assert err.count(f"HOME={env['HOME']} is not writable: caches (") == 1, err
    assert err.count(f"taking over the lock {lock} of host ") == 1, err
    assert f"pid {killed.pid}, which is gone" in err and not lock.exists(), err[-3000:]
