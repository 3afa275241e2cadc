"""The numeric-task protocol (experiments/numeric_tasks/run.py, report.py): a killed
experiment continues where it stopped and keeps its finished runs; runs of another protocol
are refused; the report's intervals come from the raw rows it saves, and again from them
alone."""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys

import pytest

from del_megatron.errors import UserError
from experiments.numeric_tasks import run as ex
from experiments.numeric_tasks.report import main as report_main
from experiments.numeric_tasks.report import read_raw, read_runs, write_report

from ..distributed.launcher import ROOT

TASKS = {"copy": ("easy", 0.0), "noisy": ("easy", 0.6)}
PROTOCOL = ex.Protocol(
    kinds=("mle", "del"),
    seeds=(1, 2, 3),
    steps=4,
    eval_every=2,
    documents=1,
    heldout=1,
    greedy_limit=1,
)


def fake_metrics(kind: str, seed: int) -> dict:
    """Made-up curves: del is 0.1 above mle on copy at every seed (plus seed noise shared
    by both kinds: the pairing removes it), and equal on noisy."""
    noise = random.Random(seed).uniform(-0.2, 0.2)
    curve = []
    for step in (2, 4):
        tasks = {}
        for task, (level, truth) in TASKS.items():
            acc = 0.4 * step / 4 + 0.45 + noise + (0.1 if kind == "del" and task == "copy" else 0)
            tasks[task] = {
                "level": level,
                "digit_acc": acc,
                "exact_teacher_forced": acc / 2,
                "exact_greedy": acc / 3 if step == 4 else math.nan,
                "digit_entropy": 1.0,
                "true_digit_entropy": truth,
                "entropy_gap": 1.0 - truth,
                "digit_ece": 0.1,
                "best_digit_acc": 1.0,
                "relative_digit_acc": acc,
            }
        curve.append({"step": step, "tasks": tasks})
    return {"kind": kind, "seed": seed, "curve": curve, "seconds": {"train": 1, "evaluate": 1}}


class Killed(Exception):
    pass


def test_a_killed_experiment_continues_and_keeps_finished_runs(tmp_path):
    calls, kills = [], [1]  # killed once, during the second run

    def worker(protocol, run, data, children):
        calls.append(run.directory.name)
        run.directory.mkdir(parents=True, exist_ok=True)
        (run.directory / "partial").write_text("")  # what a run cut short leaves
        if len(calls) == 2 and kills:
            kills.pop()
            raise Killed
        return fake_metrics(run.kind, run.seed)

    lines = []
    with pytest.raises(Killed):
        ex.run_protocol(PROTOCOL, tmp_path, worker=worker, data=tmp_path, say=lines.append)
    assert calls == ["mle-1", "del-1"]
    assert (tmp_path / "runs" / "mle-1" / "metrics.json").is_file()
    assert not (tmp_path / "runs" / "del-1" / "metrics.json").exists()
    assert len(lines) == 1 and lines[0].startswith("[1/6] mle seed 1: ")

    calls.clear()
    lines.clear()
    runs = ex.run_protocol(PROTOCOL, tmp_path, worker=worker, data=tmp_path, say=lines.append)
    assert calls == ["del-1", "mle-2", "del-2", "mle-3", "del-3"]  # mle-1 kept
    assert lines[0] == "1 of 6 runs already done, kept"
    assert [line.split(":")[0] for line in lines[1:]] == [
        "[2/6] del seed 1",
        "[3/6] mle seed 2",
        "[4/6] del seed 2",
        "[5/6] mle seed 3",
        "[6/6] del seed 3",
    ]
    assert all(r.done for r in runs)

    calls.clear()
    ex.run_protocol(PROTOCOL, tmp_path, worker=worker, data=tmp_path, say=lines.append)
    assert calls == []  # all done: nothing trained again

    longer = ex.Protocol(**{**PROTOCOL.__dict__, "steps": 8})
    with pytest.raises(UserError, match="another protocol.*steps"):
        ex.run_protocol(longer, tmp_path, worker=worker, data=tmp_path)


def test_a_run_cut_short_starts_again_from_nothing(tmp_path):
    run = ex.Run("mle", 1, tmp_path / "runs" / "mle-1")
    run.directory.mkdir(parents=True)
    (run.directory / "stale").write_text("")

    class Children:
        def run(self, command, log):
            assert not (run.directory / "stale").exists()
            if "evaluate-run" in command:
                (run.directory / "metrics.json").write_text(json.dumps(fake_metrics("mle", 1)))
            else:
                for step in (2, 4):
                    (run.directory / "checkpoints" / f"step-{step:07d}").mkdir(parents=True)

    metrics = ex.train_and_evaluate(PROTOCOL, run, tmp_path, Children())
    assert metrics["kind"] == "mle" and set(metrics["seconds"]) == {"train", "evaluate"}
    # evaluated checkpoints but the last are removed
    assert [p.name for p in (run.directory / "checkpoints").iterdir()] == ["step-0000004"]


def test_report_intervals_from_the_raw_rows(tmp_path):
    files = []
    for kind in PROTOCOL.kinds:
        for seed in PROTOCOL.seeds:
            path = tmp_path / f"{kind}-{seed}.json"
            path.write_text(json.dumps(fake_metrics(kind, seed)))
            files.append(path)
    out = tmp_path / "report"
    page = write_report(read_runs(files), out, protocol={"steps": 4}, command="cmd", minutes=1.0)
    rows = read_raw(out / "raw_runs.jsonl")
    assert len(rows) == 2 * 3 * 2 * 2  # kinds x seeds x steps x tasks
    text = page.read_text()
    # del - mle on copy is exactly 0.1 at every seed: an interval of width 0, excluding 0
    assert "* del vs mle on copy, digit accuracy: +0.100 [+0.100, +0.100] **✱**" in text
    assert "del vs mle on noisy" not in text.split("## Final metrics")[0]
    # the chance line counts every interval of 3 pairs (2 tasks x 1 kind x 5 metrics) and the
    # ones that exclude 0, the listed lines
    section = text.split("## Where an interval excludes 0")[1].split("## Final metrics")[0]
    listed = sum(line.startswith("* ") and line.endswith("**✱**") for line in section.splitlines())
    assert f"{listed} of 10 intervals exclude 0; with no real difference anywhere, about 0" in text
    assert "| copy | 2 (3/3) |" not in text  # steps to 0.8 depend on the seed noise
    for plot in ("curves.png", "effects.png", "entropy.png"):
        assert (out / plot).stat().st_size > 1000
    again = tmp_path / "again"
    assert report_main([str(out / "raw_runs.jsonl"), "--out", str(again)]) == 0
    assert (again / "report.md").read_text() == text


STOPPABLE = """
import signal, sys, threading
from pathlib import Path
from experiments.numeric_tasks import run as ex

def worker(protocol, run, data, children):
    run.directory.mkdir(parents=True)
    # the kernel hands a process's signal to any of its threads: here the worker's
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    print("signalled", flush=True)
    children.run(["sleep", "600"], run.directory / "log")  # a run in flight

protocol = ex.Protocol(kinds=("mle",), seeds=(1,), steps=1, eval_every=1, documents=1,
                       heldout=1, greedy_limit=1)
signal.signal(signal.SIGTERM, ex._stopped)
ex.run_protocol(protocol, Path(sys.argv[1]), worker=worker, data=Path(sys.argv[1]))
"""


def test_sigterm_stops_the_experiment_while_a_run_is_in_flight(tmp_path):
    """Python runs a signal's handler in the main thread only when it wakes: waiting on a
    run's future without a timeout, it slept through a SIGTERM delivered to the worker
    thread until the run ended (here 600 s). Woken, it stops the run's child and exits."""
    process = subprocess.Popen(
        [sys.executable, "-c", STOPPABLE, str(tmp_path)],
        cwd=ROOT,  # where `experiments` imports from (it is not installed)
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "signalled"  # imports done
        code = process.wait(timeout=60)
    finally:
        process.kill()
    assert code == 128 + signal.SIGTERM
