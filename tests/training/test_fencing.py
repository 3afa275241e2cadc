"""A holder whose lease ran out keeps writing (issue 52): job A, stopped (SIGSTOP: a stalled
node, a paused container) longer than its output lock's lease, has its lock taken over by
job B on another host, as designed; when A wakes it must write nothing more. Two hosts on
one machine: a UTS namespace each (`unshare -u`, root), as tests/test_output_lock.py does."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from del_megatron.checksums import verify_listed

from ..distributed.launcher import ROOT, torchrun_env
from ..test_output_lock import on_host
from ..utils import logged_steps
from .test_faults import LONG_RUN, error_lines, one_process, two_ranks, user_errors, wait_for

pytestmark = pytest.mark.slow

LEASE_S = 3  # renewed every 0.3 s by a running holder; A stops for longer than this


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("another host name needs unshare -u as root")


def start(cmd: list[str], host: str, log: Path, **env: str) -> subprocess.Popen:
    """`cmd` as a process of host `host`, its output in log.out and log.err."""
    clean = {k: v for k, v in torchrun_env().items() if not k.startswith("SLURM_")}
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        return subprocess.Popen(
            on_host(host, *cmd),
            env={**clean, "DEL_LOCK_LEASE_S": str(LEASE_S), **env},
            stdout=out,
            stderr=err,
            cwd=ROOT,
        )


def stopped(pid: int | str) -> bool:
    """Whether process `pid` is stopped (SIGSTOP)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state == "T"


def checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))


def kill_tree(proc: subprocess.Popen) -> None:
    """`proc` and every process under it (torchrun's ranks), woken first if stopped."""
    procs = []
    with contextlib.suppress(psutil.NoSuchProcess):  # ended and reaped already
        procs.append(psutil.Process(proc.pid))
        procs += procs[0].children(recursive=True)
    for each in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            each.send_signal(signal.SIGCONT)
            each.kill()
    proc.wait()


def ranks_of(proc: subprocess.Popen, nproc: int) -> list[psutil.Process]:
    """The ranks of a job: the process itself, or torchrun's workers (its children; their
    own children are data-loader workers)."""
    job = psutil.Process(proc.pid)
    return [job] if nproc == 1 else job.children()


@pytest.mark.parametrize(
    ("point", "nproc"),
    [
        ("metrics", 1),
        ("save", 1),
        ("writing", 1),
        ("publish", 1),
        ("published", 1),
        ("writing", 2),
    ],
)
def test_a_holder_that_lost_its_lock_writes_nothing_more(
    point, nproc, two_hosts, tmp_path, synth_tokenizer, synth_shards
):
    """A (host node-a, saving every 2 steps, a line a step) stops at one write point of a
    step (5, 4): before its metrics line, at the start of its save, halfway through writing
    it, before its publication (the rename) and right after it; with 2 ranks (data
    parallel), rank 0 stops halfway through writing its shard and rank 1 waits for it. B
    (host node-b) is started into the same output once A's lease has run out, takes the
    lock over and resumes from the newest checkpoint. A is woken once B has trained on:
    every rank of A stops with its one line (exit 2) and writes nothing more. B, stopped by
    SIGTERM, saves its checkpoint (exit 75), and the output is B's alone: each step once in
    metrics.jsonl, every checkpoint whole (its files as its files.json lists them), no
    staging left. Before: A said "this process's lock was taken over" and trained on,
    appending to B's metrics.jsonl, writing into B's staging directory (both
    `.tmp-step-N`), then "writing the checkpoint failed" or publishing over B's."""
    out = tmp_path / "run"
    launch = one_process if nproc == 1 else two_ranks

    def command() -> list[str]:  # each job its own rendezvous port
        args = (out, synth_tokenizer, synth_shards, LONG_RUN, "train.save_interval=2")
        return [*launch(*args, worker="paused_holder.py"), "--resume", "auto"]

    marker, errors = tmp_path / "paused", tmp_path / "errors"
    errors.mkdir()
    step = 5 if point == "metrics" else 4  # the save of 2 published before: B resumes from it
    pause = f"{point}:{step}:{marker}"
    a = start(
        command(), "node-a", tmp_path / "a", DEL_TEST_PAUSE=pause, DEL_USER_ERROR_DIR=str(errors)
    )
    b = None
    try:

        def a_stopped() -> bool:
            return marker.is_file() and bool(marker.read_text()) and stopped(marker.read_text())

        wait_for(a_stopped, f"A stopped at {point}", a, log=tmp_path / "a.err")
        a_token = json.loads((out.parent / ".run.lock").read_text()).get("token", "?")
        time.sleep(LEASE_S + 1)  # A's lease runs out
        a_said = (tmp_path / "a.out").stat().st_size, (tmp_path / "a.err").stat().st_size
        b = start(command(), "node-b", tmp_path / "b", DEL_TEST_PAUSE=f"none:0:{tmp_path / 'x'}")

        def b_trained_on() -> bool:  # two steps and a checkpoint past where B resumed
            said = (tmp_path / "b.out").read_text()
            if "resumed from" not in said:
                return False
            resumed = int(said.split("resumed from ")[1].split(" at step ")[1].split()[0])
            return (
                max(checkpoint_steps(out), default=0) > resumed
                and max(logged_steps(out / "metrics.jsonl"), default=0) >= resumed + 2
            )

        wait_for(b_trained_on, "B resumed and trained on", b, log=tmp_path / "b.err")
        err_b = (tmp_path / "b.err").read_text()
        assert f"taking over the lock {out.parent / '.run.lock'} of host node-a" in err_b, err_b
        os.kill(int(marker.read_text()), signal.SIGCONT)
        try:
            code = a.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None  # trained on
        out_a = (tmp_path / "a.out").read_bytes()[a_said[0] :].decode()
        err_a = (tmp_path / "a.err").read_bytes()[a_said[1] :].decode()
        assert code == (2 if nproc == 1 else 1), (code, out_a[-2000:], err_a[-3000:])  # torchrun: 1
        lost = f"{out}: this process's lock {out.parent / '.run.lock'} was taken over (host node-b"
        left = {name: line for name, line in user_errors(errors).items() if lost in line}
        assert sorted(left) == [f"rank-{r}" for r in range(nproc)], (user_errors(errors), err_a)
        lines = error_lines(err_a)
        assert len(lines) == 1 and lost in lines[0], err_a[-3000:]
        assert "del_megatron/" not in err_a, err_a[-3000:]  # no frame of ours (torchrun's own)
        assert nproc > 1 or "Traceback" not in err_a, err_a[-3000:]
        assert "saved" not in out_a and "step " not in out_a, out_a  # no checkpoint, no line
        # B, unharmed, trains on and stops with its checkpoint as asked
        steps = max(logged_steps(out / "metrics.jsonl"))
        wait_for(lambda: max(logged_steps(out / "metrics.jsonl")) >= steps + 2,
                 "B trained on after A woke", b, log=tmp_path / "b.err")  # fmt: skip
        for rank in ranks_of(b, nproc):
            rank.send_signal(signal.SIGTERM)
        code = b.wait(timeout=300)
        assert code == (75 if nproc == 1 else 1), (tmp_path / "b.err").read_text()[-3000:]
        if nproc == 1:  # torchrun ends a rank once another exited: its line may not come
            assert "stop requested: checkpoint of step" in (tmp_path / "b.out").read_text()
    finally:
        for proc in (a, b):
            if proc is not None:
                kill_tree(proc)

    logged = logged_steps(out / "metrics.jsonl")
    assert logged == list(range(1, logged[-1] + 1)), logged  # each step once, none missing
    root = out / "checkpoints"
    assert not [p.name for p in root.iterdir() if a_token in p.name]  # no staging of A's
    steps = checkpoint_steps(out)
    assert steps and steps[-1] <= logged[-1], (steps, logged[-1])
    if nproc == 1:  # B's stop: its checkpoint at its last line, nothing of its own left
        assert steps[-1] == logged[-1], (steps, logged[-1])
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []
    # (at 2 ranks, torchrun ends B's rank 0 once rank 1 has exited: a SIGTERM that finds a
    # rank waiting in a collective may end it before the stop's checkpoint is published)
    for step in steps:
        checkpoint = root / f"step-{step:07d}"
        index = json.loads((checkpoint / "files.json").read_text())["files"]
        assert verify_listed(checkpoint, sorted(index)) is None, checkpoint
        assert json.loads((checkpoint / "meta.json").read_text())["step"] == step
    assert not (out.parent / ".run.lock").exists()  # B gave it back


COMMIT = """
import os, signal, sys
from pathlib import Path
from del_megatron.errors import UserError
from del_megatron.outputs import abandon_output, begin_output, commit_output
final = Path(sys.argv[1])
staging = begin_output(final, lambda p: True, force=False)
(staging / "weights.bin").write_text("A's")
print("staged", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # a stalled node, before the commit
try:
    commit_output(staging, final, lambda p: True)
except UserError as err:
    abandon_output(staging)
    print(err, file=sys.stderr)
    sys.exit(2)
print("committed", flush=True)
"""


def test_a_command_whose_output_lock_was_taken_over_commits_nothing(tmp_path, two_hosts):
    """What every command that writes an output through outputs.py does (del-convert,
    data-tools build, del-eval --out), stopped between its staging and its commit longer
    than its lease while a process on another host takes the output over: it commits
    nothing, removes its staging and stops in one line. Before: it renamed its staging into
    place over the new holder's output."""
    from ..test_output_lock import hold_on, python

    final = tmp_path / "out"
    clean = {k: v for k, v in torchrun_env().items() if not k.startswith("SLURM_")}
    env = {**clean, "DEL_LOCK_LEASE_S": "1"}
    a = subprocess.Popen(
        on_host("node-a", *python(COMMIT, str(final))),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    b = None
    try:
        assert a.stdout.readline().strip() == "staged", a.stderr.read()
        wait_for(lambda: stopped(a.pid), "A stopped", a, timeout=60)
        time.sleep(2)  # longer than the lease
        b = hold_on("node-b", final, DEL_LOCK_LEASE_S="1")
        a.send_signal(signal.SIGCONT)
        out, err = a.communicate(timeout=60)
        assert a.returncode == 2 and out == "", (a.returncode, out, err)
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{final}: this process's lock {tmp_path / '.out.lock'} was taken over" in err
        assert "(host node-b, pid " in err, err
        assert not final.exists() and not list(tmp_path.glob(".out.partial*"))
    finally:
        for proc in (a, b):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                proc.wait()
