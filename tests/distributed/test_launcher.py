"""The warm-rank launcher (tests/distributed/launcher.py, fork_server.py) is a fresh rank:
what one worker leaves behind never reaches the next, the environment is torchrun's, a
failure is reported as torchrun's is, and a process group alive at the end fails the rank as
it can abort a real interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import time

import psutil
import pytest

from tests.distributed import launcher
from tests.distributed.launcher import run_torchrun

pytestmark = pytest.mark.slow
# what only a warm launch does (a whole run under DEL_COLD_RANKS=1 has none)
warm_only = pytest.mark.skipif(
    os.environ.get("DEL_COLD_RANKS") == "1", reason="DEL_COLD_RANKS=1: every launch is torchrun"
)


def said(output: str, tag: str) -> list[dict]:
    return [json.loads(line[len(tag) + 1:]) for line in output.splitlines()
            if line.startswith(tag + " ")]


@pytest.fixture
def cold(monkeypatch):
    monkeypatch.setenv("DEL_COLD_RANKS", "1")


def test_two_workers_in_a_row_on_warm_ranks_equal_cold_ranks(monkeypatch):
    run_torchrun("warm_probe.py", 2, "dirty")
    warm = said(run_torchrun("warm_probe.py", 2, "probe"), "PROBE")
    monkeypatch.setenv("DEL_COLD_RANKS", "1")
    cold = said(run_torchrun("warm_probe.py", 2, "probe"), "PROBE")
    assert warm == cold, (warm, cold)
    assert warm[0]["parallel_state"] is False and warm[0]["env"] is False
    assert warm[0]["draws_differ"] is True  # each rank seeded from entropy, as a fresh one


@warm_only
def test_the_warm_rank_environment_is_torchruns(monkeypatch):
    warm = said(run_torchrun("warm_probe.py", 2, "env"), "ENV")
    monkeypatch.setenv("DEL_COLD_RANKS", "1")
    cold = said(run_torchrun("warm_probe.py", 2, "env"), "ENV")
    # torchrun's per-worker error file (its @record decorator's) is all a warm rank lacks
    only_cold = {"TORCHELASTIC_ERROR_FILE", "DEL_COLD_RANKS"}
    by_rank = lambda rows: sorted(rows, key=lambda row: row["rank"])  # noqa: E731
    assert len(warm) == len(cold) == 2
    for w, c in zip(by_rank(warm), by_rank(cold), strict=True):
        assert set(w["names"]) == set(c["names"]) - only_cold
        assert (w["rank"], w["argv"], w["path0"]) == (c["rank"], c["argv"], c["path0"])


@warm_only
def test_a_group_alive_at_exit_fails_the_warm_rank():
    """The exit-abort class (a gloo group alive as the interpreter ends): a warm rank cannot
    finalize, so the launcher fails the rank that leaves one, naming it."""
    with pytest.raises(AssertionError, match="ended with its process group alive"):
        run_torchrun("warm_probe.py", 2, "leave")


def ranks_of_this_test() -> list[psutil.Process]:
    """The warm server's children: the ranks it forked that are still running."""
    server = launcher.server_for(launcher.torchrun_env())
    return psutil.Process(server.proc.pid).children() if server else []


def test_a_failing_rank_is_reported_and_its_peers_stopped():
    before = {p.pid for p in ranks_of_this_test()}
    with pytest.raises(AssertionError) as failed:
        run_torchrun("warm_probe.py", 2, "fail")
    report = str(failed.value)
    assert "ValueError: rank 1 fails on purpose" in report
    assert "warm_probe.py on 2 ranks exited" in report
    time.sleep(0.5)
    assert {p.pid for p in ranks_of_this_test()} <= before  # no rank left behind


@warm_only
def test_a_launch_past_its_timeout_is_killed():
    before = {p.pid for p in ranks_of_this_test()}
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun("warm_probe.py", 2, "hang", timeout=3)
    time.sleep(0.5)
    assert {p.pid for p in ranks_of_this_test()} <= before


@warm_only
def test_a_launch_that_changes_an_import_time_setting_runs_cold(monkeypatch):
    """PYTHON* is read as the interpreter starts (OMP_NUM_THREADS as torch loads): a warm rank
    could not honour another value than the server started with."""
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert launcher.server_for(launcher.torchrun_env()) is None
