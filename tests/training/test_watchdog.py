"""A peer that freezes mid-training (issue 52): SIGSTOP to one rank of a real 2-rank run (a
hung GPU, a stalled node). The other says, within parallel.stall_seconds, which operation it
waits in and which peer it waits for, and a SIGTERM then ends it at once in one line: exit
75 where a checkpoint exists to continue from, else 1. Before: nothing said for 45 s, the
TERM ignored for 30 s and more, the rank held until the collective timeout (an hour).

Fresh processes started as srun starts them (the subject is the process and its signals);
the stall setting short (2 s) so the test waits seconds. No time is asserted but generous
bounds on waiting for a line or an exit (hangs, not speed)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..distributed.launcher import ROOT, free_port, srun_environment
from ..utils import logged_steps
from .test_resume import env, train_args

STALL = "parallel.stall_seconds=2"
BOUND_S = 60  # for a line or an exit: a hang, not a speed claim
# what a rank waits in between steps: the step, its agreement, a checkpoint's collectives
OPERATIONS = (
    "the training step's collectives (forward, backward, optimizer) of step ",
    "the step's agreement",
    "all_gather_object over every rank from ",  # a checkpoint's, the output lock's
    "barrier over every rank from ",
)


def operation(line: str) -> str:
    """What a rank's line says it waits in: after '... waiting N s (since HH:MM:SS UTC) in '."""
    return line.split(" UTC) in ", 1)[1]


def start(args: list[str], nproc: int, logs: Path) -> list[subprocess.Popen]:
    """del-train's ranks, each its own session (its data worker with it), stdout and stderr
    to logs/rank<N>.out / .err."""
    port = free_port()
    ranks = []
    for rank in range(nproc):
        with open(logs / f"rank{rank}.out", "w") as out, open(logs / f"rank{rank}.err", "w") as err:
            ranks.append(
                subprocess.Popen(
                    [sys.executable, "-m", "del_megatron.cli.train", *args],
                    env={**env(), **srun_environment(rank, nproc, port)},
                    stdout=out,
                    stderr=err,
                    cwd=ROOT,
                    start_new_session=True,
                )
            )
    return ranks


def wait_until(predicate, what: str, ranks: list[subprocess.Popen], log: Path) -> None:
    deadline = time.monotonic() + 300
    while not predicate():
        tail = log.read_text()[-3000:]
        assert all(r.poll() is None for r in ranks), f"{what}: a rank ended\n{tail}"
        assert time.monotonic() < deadline, f"{what}: not within 300 s\n{tail}"
        time.sleep(0.05)


def said(log: Path, *parts: str) -> list[str]:
    """The lines of `log` holding every one of `parts`."""
    return [line for line in log.read_text().splitlines() if all(p in line for p in parts)]


def line_within(log: Path, what: str, proc: subprocess.Popen, *parts: str) -> str:
    """The first line of `log` holding every one of `parts`, waited for BOUND_S."""
    deadline = time.monotonic() + BOUND_S
    while not (found := said(log, *parts)):
        assert proc.poll() is None, (
            f"{what}: the rank ended ({proc.returncode})\n{log.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, (
            f"{what}: no such line within {BOUND_S} s\n{log.read_text()[-3000:]}"
        )
        time.sleep(0.1)
    return found[0]


def end(ranks: list[subprocess.Popen]) -> None:
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rank.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
        rank.wait()


@pytest.mark.slow
def test_a_frozen_peer_at_data_parallel_2_is_named_and_sigterm_ends_the_rank_with_75(
    tmp_path, synth_tokenizer, synth_shards
):
    """DeepSpeed (ZeRO 2) at DP 2, a checkpoint every 2 steps: rank 1 stopped once a
    checkpoint exists. Rank 0 (it serves the rendezvous store) names the training step's
    collectives and rank 1 with no sign of life; SIGTERM: one line, exit 75, the same command
    continues from the newest checkpoint, which is complete."""
    out = tmp_path / "run"
    args = train_args(
        out,
        synth_tokenizer,
        synth_shards,
        "train.steps=100000",
        "train.log_interval=1",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.save_interval=2",
        STALL,
        tp=1,
    )
    ranks = start(args, 2, tmp_path)
    err = tmp_path / "rank0.err"
    try:
        checkpoints = out / "checkpoints"

        def saved_and_on() -> bool:
            return (
                any(checkpoints.glob("step-*/files.json"))
                and len(logged_steps(out / "metrics.jsonl")) >= 3
            )

        wait_until(saved_and_on, "a checkpoint, then a step", ranks, err)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        named = line_within(
            err,
            "rank 0's line naming rank 1",
            ranks[0],
            "rank 0 of 2",
            " waiting ",
            "no sign of life",
        )
        assert "rank 1 (host " in named and f"pid {ranks[1].pid}" in named, named
        assert operation(named).startswith(OPERATIONS), named
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(timeout=BOUND_S) == 75, err.read_text()[-3000:]
        text = err.read_text()
        last = text.strip().splitlines()[-1]
        assert last.startswith("del-train: stopped by SIGTERM while rank 0 of 2 "), last
        newest = sorted(checkpoints.glob("step-*"))[-1]
        assert f" unsaved; the same command continues from {newest}" in last, last
        assert (newest / "files.json").is_file()
        assert "Traceback" not in text, text[-3000:]
    finally:
        end(ranks)


@pytest.mark.slow
def test_a_frozen_stage_at_pipeline_parallel_2_is_named_and_sigterm_ends_the_rank_with_1(
    tmp_path, synth_tokenizer, synth_shards
):
    """megatron-core's engine at PP 2, no checkpoints: rank 0 (the first stage, and the
    rendezvous store's server) stopped mid-training. Rank 1 names the training step's
    collectives and rank 0 (its store does not answer); SIGTERM: one line, exit 1, nothing
    to continue from."""
    out = tmp_path / "run"
    args = train_args(
        out,
        synth_tokenizer,
        synth_shards,
        "train.steps=100000",
        "train.log_interval=1",
        "train.engine=megatron",
        "train.checkpoints=false",
        "parallel.pipeline_parallel=2",
        STALL,
        tp=1,
    )
    ranks = start(args, 2, tmp_path)
    err = tmp_path / "rank1.err"
    try:
        wait_until(lambda: len(logged_steps(out / "metrics.jsonl")) >= 3, "3 steps", ranks, err)
        os.kill(ranks[0].pid, signal.SIGSTOP)
        named = line_within(
            err, "rank 1's line naming rank 0", ranks[1], "rank 1 of 2", " waiting ", "rank 0's"
        )
        assert operation(named).startswith(OPERATIONS), named
        assert "has not answered" in named, named
        ranks[1].send_signal(signal.SIGTERM)
        assert ranks[1].wait(timeout=BOUND_S) == 1, err.read_text()[-3000:]
        text = err.read_text()
        last = text.strip().splitlines()[-1]
        assert last.startswith("del-train: stopped by SIGTERM while rank 1 of 2 "), last
        assert last.endswith(" unsaved; no checkpoint to continue from"), last
        assert "Traceback" not in text, text[-3000:]
    finally:
        end(ranks)


# One process, the run's stop handlers and its watchdog (stall 0.5 s), an operation that
# sleeps in place of a collective: which stops end it. Each case prints what it reached.
ONE_PROCESS = """
import os, signal, sys, time
from del_megatron import watchdog
from del_megatron.training.signals import StopRequest

case = sys.argv[1]
saved = "ckpt" if case == "agreed" else None
with StopRequest() as stop, watchdog.watching(
    rank=0, world=1, stall_s=0.5, continues_from=lambda: saved
):
    if case == "ordinary":  # a stop before any stall: the run's own, the step finishes
        with watchdog.waiting("the training step", of="step 1"):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.1)
        time.sleep(1.5)  # the watchdog has ticks to act in: it must not
        print("finished, stop recorded:", stop.received == signal.SIGUSR1, flush=True)
    elif case == "stalled":  # a stall, then SIGTERM: the rank ends at once, exit 1
        with watchdog.waiting("the training step", of="step 3"):
            time.sleep(1.5)
            print("stalled", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        print("not ended", flush=True)
    elif case == "agreed":  # a stop every rank agreed on: its save is not cut short
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        watchdog.stop_agreed()
        with watchdog.waiting("saving the checkpoint", of="step 4"):
            time.sleep(1.5)  # past the stall: said, not ended
        print("saved", flush=True)
        with watchdog.waiting("publishing the checkpoint"):
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGTERM)  # a new stop during a stall: ends it
            time.sleep(60)
        print("not ended", flush=True)
"""


@pytest.mark.parametrize(
    ("case", "code", "printed", "last"),
    [
        ("ordinary", 0, "finished, stop recorded: True", None),
        ("stalled", 1, "stalled", "step 3 unsaved; no checkpoint to continue from"),
        (
            "agreed",
            75,
            "saved",
            "the step in progress unsaved; the same command continues from ckpt",
        ),
    ],
)
def test_which_stop_ends_a_wait(case, code, printed, last):
    """A stop signal before any stall is the run's ordinary stop (the step finishes, the
    handler records it); one during a stall ends the rank in one line (exit 1: nothing to
    continue from); once a stop was agreed, its checkpoint's save is not cut short by it, a
    new one during a stall ends the rank (exit 75: a checkpoint to continue from)."""
    done = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, case],
        env=env(),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=BOUND_S,
        check=False,
    )
    assert done.returncode == code, done.stdout + done.stderr
    assert printed in done.stdout.splitlines(), done.stdout + done.stderr
    assert "not ended" not in done.stdout and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("del-train: ")]
    if last is None:
        assert not [line for line in lines if "waiting" in line or "stopped" in line], lines
        return
    assert lines[-1].startswith("del-train: stopped by SIGTERM while rank 0 of 1 "), lines
    assert lines[-1].endswith(last), lines[-1]
    assert any(" waiting " in line for line in lines[:-1]), lines  # the stall said first
