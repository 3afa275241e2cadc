"""The one lock of an output (del_megatron/outputs.py), held by a real other process: every
command that writes an output refuses to write beside it, naming that process."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HOLD = """
import sys, time
from pathlib import Path
from del_megatron.outputs import output_lock
with output_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def held(tmp_path):
    """hold(path): another process holding path's lock until the test ends; its pid."""
    procs = []

    def hold(path: Path) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc.pid

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_every_writer_refuses_an_output_another_process_holds(tmp_path, held, capsys):
    from del_megatron.cli.convert import main as convert
    from del_megatron.cli.eval import main as evaluate

    where = f"being written by another process (host {socket.gethostname()}, pid"
    from .models.tiny_hf import tiny_hf_model

    tiny_hf_model("llama-mha", tmp_path / "hf")
    pid = held(tmp_path / "m" / "model")  # hf-to-megatron writes <out>/model
    argv = ["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")]
    assert convert(argv) == 2
    assert f"{where} {pid})" in capsys.readouterr().err
    pid = held(tmp_path / "eval")
    problems = tmp_path / "problems.jsonl"
    problems.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    argv = ["/nonexistent/model", "--gsm8k", str(problems), "--shots", "0"]
    assert evaluate([*argv, "--out", str(tmp_path / "eval")]) == 2
    assert f"{where} {pid})" in capsys.readouterr().err  # before the model is looked at


# ---- ownership that survives its owner (issue 37) ---------------------------------------
#
# Other hosts without other machines: a UTS namespace (`unshare -u`, root) gives a process
# its own host name, so a lock it holds names a host the taker is not on, as on a cluster
# where the node that held it died.

TAKE = """
import sys
from pathlib import Path
from del_megatron.outputs import OutputLocked, acquire_output_lock
try:
    acquire_output_lock(Path(sys.argv[1]))
    print("taken", flush=True)
except OutputLocked as err:
    print("refused:", err, flush=True)
"""


def on_host(name: str | None, *command: str) -> list[str]:
    """`command` as a process of host `name` (None: this host)."""
    if name is None:
        return list(command)
    return ["unshare", "-u", "sh", "-c", 'hostname "$0" && exec "$@"', name, *command]


def python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def lock_env(**env: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**clean, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **env}


def hold_on(host: str | None, path: Path, **env: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        on_host(host, *python(HOLD, str(path))),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=lock_env(**env),
    )
    assert proc.stdout.readline().strip() == "held", proc.stderr.read()
    return proc


def take_on(host: str | None, path: Path, **env: str) -> tuple[str, str]:
    done = subprocess.run(
        on_host(host, *python(TAKE, str(path))),
        capture_output=True,
        text=True,
        env=lock_env(**env),
        timeout=60,
        check=True,
    )
    return done.stdout.strip(), done.stderr.strip()


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("another host name needs unshare -u as root")
    procs = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_lock_is_taken_over_only_from_a_holder_that_is_provably_gone(tmp_path, hosts):
    """What a dead process leaves behind (issue 37). Live holders on two hosts (another
    host's, which renews its lease, and this host's) are never taken over; a holder on
    another host killed with its node (SIGKILL: no cleanup) is taken over once its lease
    has run out, and at once by the requeued run of the same SLURM job, each with one line
    naming it. Before: a lock naming another host was never taken over ('if that process is
    gone, remove ...'), so a requeue onto another node needed a person."""
    short = {"DEL_LOCK_LEASE_S": "1"}  # renewed every 0.1 s by a live holder
    a_live, here_live, a_dead, job_dead = (tmp_path / n for n in ("a", "here", "dead", "job"))
    hosts.append(hold_on("node-a", a_live, **short))
    hosts.append(hold_on(None, here_live, **short))
    dead = hold_on("node-a", a_dead, **short)
    requeued = hold_on("node-a", job_dead, SLURM_JOB_ID="77", DEL_LOCK_LEASE_S="600")
    for proc in (dead, requeued):
        proc.kill()  # the node dies: no cleanup
        proc.wait()
    time.sleep(2)  # longer than the short lease
    for host, path in (("node-b", a_live), ("node-b", here_live), (None, here_live)):
        out, _ = take_on(host, path, **short)
        assert out.startswith(f"refused: {path}: being written by another process"), out
    here_dead = hold_on(None, tmp_path / "here-dead")
    here_dead.kill()
    here_dead.wait()
    out, err = take_on(None, tmp_path / "here-dead")  # this host's dead pid: at once
    assert out == "taken" and f"pid {here_dead.pid}, which is gone" in err, (out, err)
    out, err = take_on("node-b", a_dead, **short)
    assert out == "taken", out
    assert f"{a_dead}: taking over the lock" in err and f"of host node-a, pid {dead.pid}" in err
    assert "which has not renewed it for " in err and err.count("\n") == 0, err
    # the same job's next run (SLURM requeues it onto another node) takes over at once;
    # another job waits out the lease (10 minutes here): refused
    out, _ = take_on("node-b", job_dead, SLURM_JOB_ID="78", SLURM_RESTART_COUNT="1")
    assert out.startswith("refused:") and "host node-a" in out, out
    out, err = take_on("node-b", job_dead, SLURM_JOB_ID="77", SLURM_RESTART_COUNT="1")
    assert out == "taken", out
    assert f"of host node-a, pid {requeued.pid}, this job's earlier run (SLURM job 77" in err
    assert "which SLURM requeued" in err, err


BUILD = """
import sys, time
from pathlib import Path
from del_megatron import locks
assert locks.try_take(Path(sys.argv[1]), "a build") is None  # what LeasedBaton takes
print("held", flush=True)
time.sleep(120)
"""


def test_a_torch_extension_build_lock_left_by_a_killed_build_is_taken_over(
    tmp_path, monkeypatch, capsys
):
    """What a dead process leaves behind in a dependency (issue 37): torch's extension
    build (DeepSpeed's ops are built through it at every start) waited forever on the
    `lock` a killed build left, so every later start hung in 'building the model'. Installed
    as in del-train's start-up (parallel.init_distributed), the lock names its builder: a
    builder that is gone is taken over at once, one that dies while waited for too, and a
    lock plain torch left (no builder named) once it is older than the lease."""
    from torch.utils import cpp_extension

    from del_megatron import extension_builds

    monkeypatch.setattr(cpp_extension, "FileBaton", cpp_extension.FileBaton)  # put back
    monkeypatch.setattr(cpp_extension, "load", cpp_extension.load)
    monkeypatch.setattr(extension_builds, "FIRST_SAY_S", 0.2)
    extension_builds.install()
    build = tmp_path / "deepspeed_shm_comm"
    build.mkdir()
    lock = build / "lock"
    killed = subprocess.Popen(python(BUILD, str(lock)), stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "held"
    killed.kill()  # SIGKILL mid-build: no cleanup, the lock stays
    killed.wait()
    capsys.readouterr()
    baton = cpp_extension.FileBaton(str(lock))
    assert baton.try_acquire()  # torch's own FileBaton: False, then wait() forever
    err = capsys.readouterr().err
    assert f"torch extension build {build}: taking over the lock {lock} of host " in err
    assert f"pid {killed.pid}, which is gone" in err, err
    baton.release()
    assert not lock.exists()

    lock.write_text("")  # plain torch's lock: names no builder
    assert not cpp_extension.FileBaton(str(lock)).try_acquire()  # fresh: a build, perhaps
    os.utime(lock, (time.time() - 700, time.time() - 700))  # older than the 600 s lease
    assert cpp_extension.FileBaton(str(lock)).try_acquire()
    assert "no holder named in it, which has not renewed it for 70" in capsys.readouterr().err
    cpp_extension.FileBaton(str(lock)).release()

    builder = subprocess.Popen(python(BUILD, str(lock)), stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "held"
    waiter = cpp_extension.FileBaton(str(lock))
    assert not waiter.try_acquire()  # a live build: waited for, said within seconds
    threading.Timer(1.0, builder.kill).start()  # it dies while this process waits
    with pytest.raises(extension_builds._HolderGone):  # cpp_extension.load builds again
        waiter.wait()
    builder.wait()
    err = capsys.readouterr().err
    assert f"waiting 0 s for the build by host {socket.gethostname()}, pid {builder.pid}" in err
    assert f"pid {builder.pid}, which is gone" in err, err
    assert not lock.exists()
