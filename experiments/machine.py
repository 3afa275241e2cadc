"""The machine, date and commit of a run, as protocol.json records them and the pages print them."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}"


def commit() -> str:
    """The checkout's commit, and whether its tracked files differ from it (a run started
    from edited code is not the commit's run); 'unknown' outside a git checkout."""
    import subprocess

    from . import REPOSITORY

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", str(REPOSITORY), *args], capture_output=True, text=True, check=False
        )

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return "unknown (not a git checkout)"
        clean = git("diff", "--quiet", "HEAD", "--").returncode == 0
    except OSError:  # no git
        return "unknown (no git)"
    return head.stdout.strip()[:12] + ("" if clean else " with uncommitted changes")


def provenance() -> dict:
    """Where and when a run was made, recorded in protocol.json with its raw rows when the
    run ends (every page reads it from there, never from the machine regenerating it)."""
    import datetime

    return {"date": str(datetime.date.today()), "machine": machine(), "commit": commit()}
