"""Run a worker on N ranks (gloo, CPU) and fail with its errors if it fails.

`run_torchrun` runs each rank as a fork of a warm server that has torch, megatron-core,
DeepSpeed and the package imported already (tests/distributed/fork_server.py), with the
environment torchrun would give it: the same worker code, the same gloo groups, the same
assertions, about 5 s of CPU less per rank. `DEL_COLD_RANKS=1` runs every launch under
torchrun instead (fresh interpreters), as does a launch whose environment changes what the
server read at import (OMP_NUM_THREADS, PYTHON*, DS_*, ...). Tests whose subject is the
process boundary itself (signals, SIGKILL, torchrun's behaviour, a command's exit status)
start real processes with `torchrun_command`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.distributed import fork_server

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"


# del_megatron/rendezvous.py's line for a MASTER_PORT another process holds
PORT_TAKEN = "is in use on this host (another job?): choose another MASTER_PORT"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore::UserWarning",
    )
    return env


def torchrun_command(worker: str, nproc: int, *args: str) -> list[str]:
    """tests/distributed/workers/<worker>, or a module given as '-m name', on `nproc` ranks."""
    target = ["-m", worker[3:]] if worker.startswith("-m ") else [str(WORKERS / worker)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *target,
        *args,
    ]


def run_torchrun(worker: str, nproc: int, *args: str, timeout: float = 600) -> str:
    """Run a worker to completion on warm ranks (cold ones under DEL_COLD_RANKS=1); return its
    output (every rank's stdout, then every rank's stderr), or fail with its errors."""
    proc = launch(worker, nproc, list(args), torchrun_env(), timeout)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and PORT_TAKEN in output:
        # free_port's port was bound by another test's process between the pick and the
        # rendezvous (two pytest workers side by side), which our rendezvous refuses in one
        # line, as it should: start again on a new port, as its message tells a user to
        proc = launch(worker, nproc, list(args), torchrun_env(), timeout)
        output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(failed_launch(f"{worker} on {nproc} ranks", proc.returncode, output))
    return output


def launch(worker: str, nproc: int, args: list[str], env: dict, timeout: float):
    """`torchrun --nproc_per_node=nproc worker args` to completion, warm where it can be; a
    CompletedProcess whose status is torchrun's (1 when a rank failed, the rank's own status
    said in stderr)."""
    if os.environ.get("DEL_COLD_RANKS") != "1" and server_for(env) is not None:
        return run_warm(worker, nproc, args, env, timeout)
    return run_cold(worker, nproc, args, env, timeout)


def run_command(cmd: list[str], *, env: dict, timeout: float = 600, cwd: Path = ROOT):
    """subprocess.run(cmd, capture_output=True, text=True) for a command of this module's
    making: a `torchrun_command` runs on warm ranks, `python -m module ...` / `python
    script ...` as a warm process (run_python); any other command as it is."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if cmd[:3] == torchrun and cwd == ROOT:
        nproc = int(cmd[3].removeprefix("--nproc_per_node="))
        rest = cmd[6:]  # after --master_addr and --master_port: the worker, then its arguments
        worker, args = (f"-m {rest[1]}", rest[2:]) if rest[0] == "-m" else (rest[0], rest[1:])
        return launch(worker, nproc, args, env, timeout)
    if cmd[:1] == [sys.executable] and len(cmd) > 1:
        target, args = (f"-m {cmd[2]}", cmd[3:]) if cmd[1] == "-m" else (cmd[1], cmd[2:])
        return run_python(target, *args, env=env, cwd=cwd, timeout=timeout)
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)


def run_cold(worker: str, nproc: int, args: list[str], env: dict, timeout: float):
    return subprocess.run(torchrun_command(worker, nproc, *args), env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, check=False)


# ---- warm ranks ----------------------------------------------------------------------------

# torchrun's own grace between the SIGTERM it sends the other ranks when one fails and SIGKILL
STOP_GRACE_S = 30


def rank_environment(env: dict, rank: int, nproc: int, port: int, run_id: str) -> dict:
    """What torchrun's local agent sets for a worker (torch/distributed/elastic/agent/server/
    local_elastic_agent.py), one node, no agent store: rank 0 serves the rendezvous."""
    return {
        **env,
        **srun_environment(rank, nproc, port),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


class WarmRank:
    """One rank forked by the server; the server reports its exit on the connection."""

    def __init__(self, conn: socket.socket, stdout: Path, stderr: Path):
        self.conn, self.stdout, self.stderr = conn, stdout, stderr
        self.said = b""
        while b"\n" not in self.said:
            chunk = conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the fork server did not start the rank: {self.said!r}")
            self.said += chunk
        first, self.said = self.said.split(b"\n", 1)
        self.pid = int(first.split()[1])
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.conn.fileno() != -1:
            try:
                self.said += self.conn.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            if self.said.startswith(b"exit ") and self.said.endswith(b"\n"):
                self.returncode = int(self.said.split()[1])
                self.conn.close()
        return self.returncode

    # Popen's interface, for tests that follow a rank (tests/training/test_resume.start_ranks)

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"warm rank {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """(stdout then stderr, None): as Popen(stdout=PIPE, stderr=STDOUT, text=True)."""
        self.wait(timeout)
        said = self.stdout.read_text(errors="replace") + self.stderr.read_text(errors="replace")
        return said, None

    def signal_group(self, sig: int) -> None:
        """The rank and what it started (a data loader's workers): its session's group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


class ForkServer:
    def __init__(self, env: dict):
        self.folder = Path(tempfile.mkdtemp(prefix="del-fork-server-"))
        self.socket = self.folder / "server.sock"
        self.imported_with = fork_server.import_time_environment(env)
        self.log = self.folder / "server.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.fork_server", str(self.socket)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        atexit.register(self.close)
        said = []  # what its imports print (DeepSpeed's accelerator notice), then "ready"
        while not said or said[-1] not in ("ready", ""):
            said.append(self.proc.stdout.readline().strip())
        if said[-1] != "ready":
            raise RuntimeError(
                f"the fork server did not start: {said} {self.log.read_text()[-3000:]}"
            )

    def close(self) -> None:
        """End the server (its standard input closed: it kills what it still runs) and remove
        its folder, the ranks' output kept there included."""
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)

    def start(self, target: str, args: list[str], env: dict, out: Path, cwd: Path = ROOT):
        stdout, stderr = out.with_suffix(".out"), out.with_suffix(".err")
        request = {"target": target, "args": args, "env": env, "cwd": str(cwd),
                   "stdout": str(stdout), "stderr": str(stderr)}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self.socket))
        conn.sendall((json.dumps(request) + "\n").encode())
        return WarmRank(conn, stdout, stderr)


_SERVER: ForkServer | None = None


def server_for(env: dict) -> ForkServer | None:
    """The session's fork server (started at the first warm launch), or None when this launch's
    environment differs from what the server imported with."""
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = ForkServer(env)
    if fork_server.import_time_environment(env) != _SERVER.imported_with:
        return None
    return _SERVER


def worker_target(worker: str) -> str:
    return worker if worker.startswith("-m ") else str(WORKERS / worker)


def run_warm(worker: str, nproc: int, args: list[str], env: dict, timeout: float):
    """Every rank forked from the warm server; when one fails the others get SIGTERM, then
    SIGKILL after torchrun's grace, as torchrun does."""
    server = server_for(env)
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    with tempfile.TemporaryDirectory(prefix="del-warm-ranks-") as scratch:
        ranks: list[WarmRank] = []
        try:
            for rank in range(nproc):
                rank_env = rank_environment(env, rank, nproc, port, run_id)
                ranks.append(server.start(worker_target(worker), args, rank_env,
                                          Path(scratch) / f"rank{rank}"))
            status = wait_for(ranks, time.monotonic() + timeout, worker, nproc, timeout)
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.signal_group(signal.SIGKILL)
        stdout = "".join(r.stdout.read_text(errors="replace") for r in ranks)
        stderr = "".join(r.stderr.read_text(errors="replace") for r in ranks)
    if status != 0:  # as torchrun: status 1, and which rank failed how
        failed = next(i for i, r in enumerate(ranks) if r.returncode == status)
        stderr += f"\nwarm launch: rank {failed} failed first (exit status {status})\n"
    cmd = torchrun_command(worker, nproc, *args)
    return subprocess.CompletedProcess(cmd, 0 if status == 0 else 1, stdout, stderr)


def start_ranks(target: str, args: list[str], nproc: int, env: dict) -> list[WarmRank]:
    """`nproc` warm ranks started as srun starts them (one process per rank, RANK, WORLD_SIZE,
    LOCAL_RANK and the rendezvous from the environment, no launcher), each followed alone:
    Popen's poll, send_signal, wait and communicate. For a test whose subject is the run
    (what a resume at another layout trains), not the process; the caller kills what is left."""
    port = free_port()
    server = None if os.environ.get("DEL_COLD_RANKS") == "1" else server_for(env)
    if server is None:
        return [cold_rank(target, args, {**env, **srun_environment(rank, nproc, port)})
                for rank in range(nproc)]
    scratch = Path(tempfile.mkdtemp(prefix="ranks-", dir=server.folder))  # removed with it
    return [server.start(target, args, {**env, **srun_environment(rank, nproc, port)},
                         scratch / f"rank{rank}") for rank in range(nproc)]


def srun_environment(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def python_argv(target: str, args: list[str]) -> list[str]:
    """`python`'s arguments for a script's path or "-m module", then the worker's."""
    return [*target.split(" ", 1), *args] if target.startswith("-m ") else [target, *args]


def cold_rank(target: str, args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *python_argv(target, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def run_python(
    target: str, *args: str, env: dict | None = None, cwd: Path = ROOT, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python target args...` (a script's path, or "-m module") as one warm process: for a test
    about what a command computes (del-eval's metrics, del-train's run), not about the process
    (its signals, what the interpreter does at exit). Same environment rule as run_torchrun:
    cold under DEL_COLD_RANKS=1 or when `env` changes what the server imported with."""
    env = dict(os.environ if env is None else env)
    env.setdefault("PYTHONPATH", str(ROOT))
    argv = python_argv(target, list(args))
    server = None if os.environ.get("DEL_COLD_RANKS") == "1" else server_for(env)
    if server is None:
        return subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, check=False)
    with tempfile.TemporaryDirectory(prefix="del-warm-process-") as scratch:
        process = server.start(target, list(args), env, Path(scratch) / "process", cwd)
        try:
            wait_for([process], time.monotonic() + timeout, target, 1, timeout)
        finally:
            if process.poll() is None:
                process.signal_group(signal.SIGKILL)
        return subprocess.CompletedProcess(
            [sys.executable, *argv], process.returncode,
            process.stdout.read_text(errors="replace"), process.stderr.read_text(errors="replace")
        )


def wait_for(ranks: list[WarmRank], deadline: float, worker: str, nproc: int, timeout: float):
    """The launch's status: 0, or the status of the rank that failed first."""
    first_failure, stop_by = None, None
    while True:
        codes = [rank.poll() for rank in ranks]
        if first_failure is None:
            first_failure = next((c for c in codes if c not in (None, 0)), None)
        if all(c is not None for c in codes):
            return first_failure or 0
        now = time.monotonic()
        if first_failure is not None and stop_by is None:  # as torchrun: stop the others
            stop_by = now + STOP_GRACE_S
            for rank, code in zip(ranks, codes, strict=False):
                if code is None:
                    rank.signal_group(signal.SIGTERM)
        if (stop_by is not None and now > stop_by) or now > deadline:
            for rank in ranks:
                rank.signal_group(signal.SIGKILL)
            if first_failure is None:
                raise subprocess.TimeoutExpired(f"{worker} on {nproc} warm ranks", timeout)
        time.sleep(0.02)


def failed_launch(what: str, returncode: int, output: str) -> str:
    """A failed launch's report: every rank's error lines (the rank that failed first says
    its own early; the tail is the launcher's report and the peers that lost it), then the
    tail."""
    errors = "\n".join(line for line in output.splitlines() if "rror" in line)[-3000:]
    return f"{what} exited {returncode}:\n{errors}\n...\n{output[-4000:]}"
