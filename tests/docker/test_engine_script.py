"""tests/docker/engine.sh without Docker: stand-ins for dockerd, docker and debootstrap on PATH.

CI runs `engine.sh prepare` in the background, and the container test's own prepare waits on
its lock. A dockerd started by the first prepare inherited the lock's descriptor and held the
lock for as long as it ran: the test's prepare waited until CI's time ran out."""

from __future__ import annotations

import os
import signal
import subprocess

from ..distributed.launcher import ROOT

ENGINE = ROOT / "tests" / "docker" / "engine.sh"

FAKE_DOCKERD = """#!/usr/bin/env bash
# dockerd --pidfile FILE: answers (for the fake client) until killed
while [ $# -gt 0 ]; do [ "$1" = --pidfile ] && echo $$ >"$2"; shift; done
touch "$FAKE_STATE/up"
exec sleep 120
"""
FAKE_DOCKER = """#!/usr/bin/env bash
case "$1" in
  info) [ -f "$FAKE_STATE/up" ] ;;
  buildx) exit 0 ;;
  *) exit 1 ;;  # image inspect: no image yet
esac
"""
FAILING = "#!/usr/bin/env bash\nexit 1\n"


def test_a_dockerd_started_by_prepare_does_not_hold_its_lock(tmp_path):
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    for name, text in (
        ("dockerd", FAKE_DOCKERD),
        ("docker", FAKE_DOCKER),
        ("docker-compose", FAILING),
        ("debootstrap", FAILING),  # prepare stops at its second phase, after starting dockerd
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DEL_DOCKER_STATE": str(state),
        "FAKE_STATE": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(ENGINE), "prepare"], env=env, capture_output=True, text=True, timeout=120
    )
    pid = int((state / "dockerd.pid").read_text())
    try:
        assert "dockerd started" in proc.stderr, proc.stderr
        assert proc.returncode != 0  # the failing debootstrap
        os.kill(pid, 0)  # the engine runs on after prepare
        assert os.getsid(pid) == pid  # in its own session: a stopped prepare's group is not it
        free = subprocess.run(
            ["flock", "-n", str(state / "prepare.lock"), "true"], capture_output=True, timeout=30
        )
        assert free.returncode == 0, "the running dockerd holds prepare's lock"
        # a second prepare starts at once, not waiting for the first one's dockerd
        again = subprocess.run(
            ["bash", str(ENGINE), "prepare"], env=env, capture_output=True, text=True, timeout=60
        )
        assert "waiting for the prepare already running" not in again.stderr, again.stderr
        assert "engine answers" in again.stderr, again.stderr
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_prepare_that_waits_says_for_what(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "timings.new").write_text("engine 1\nrootfs 70\n")
    env = {**os.environ, "DEL_DOCKER_STATE": str(state)}
    holder = subprocess.Popen(["flock", str(state / "prepare.lock"), "sleep", "60"])
    try:
        for _ in range(100):  # until the holder has the lock
            if subprocess.run(["flock", "-n", str(state / "prepare.lock"), "true"]).returncode:
                break
            subprocess.run(["sleep", "0.1"])
        waiting = subprocess.Popen(
            ["bash", str(ENGINE), "prepare"], env=env, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        line = waiting.stderr.readline()
        os.killpg(waiting.pid, signal.SIGKILL)  # its flock too
        waiting.wait()
    finally:
        holder.kill()
        holder.wait()
    assert "waiting for the prepare already running" in line, line
    assert str(state / "prepare.lock") in line and "rootfs 70" in line, line
