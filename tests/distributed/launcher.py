"""Spawn a worker under torchrun (gloo, CPU) and fail with its errors if it fails."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"


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
    """Run a worker to completion; return its output, or fail with its errors."""
    proc = subprocess.run(
        torchrun_command(worker, nproc, *args),
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(failed_launch(f"{worker} on {nproc} ranks", proc.returncode, output))
    return output


def failed_launch(what: str, returncode: int, output: str) -> str:
    """A failed launch's report: every rank's error lines (the rank that failed first says
    its own early; the tail is the launcher's report and the peers that lost it), then the
    tail."""
    errors = "\n".join(line for line in output.splitlines() if "rror" in line)[-3000:]
    return f"{what} exited {returncode}:\n{errors}\n...\n{output[-4000:]}"
