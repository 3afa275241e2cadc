"""del-train that stops itself (SIGSTOP: a stalled node, a paused container) at one write
point of one step, so that a test can let its output lock's lease run out, have another job
take the output over, then wake it (SIGCONT) exactly there.

DEL_TEST_PAUSE="<point>:<step>:<marker file>", point one of
  metrics    before the metrics line of `step` is written (Reporter.flush)
  save       at the start of the save of `step` (before its staging exists)
  writing    during it: its first file written, the rest not (the writer's thread)
  publish    at its publication: every file and files.json written, before the rename
  published  after it: right after the rename (its next write is a metrics line)
Rank 0 stops (the others then wait for it); the marker, written just before the stop, holds
its pid. Arguments: del-train's.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from del_megatron.checkpoint import publish, writer
from del_megatron.cli.train import main
from del_megatron.training import checkpointing, metrics

POINT, STEP, MARKER = os.environ["DEL_TEST_PAUSE"].split(":", 2)
STEP_NAME = f"step-{int(STEP):07d}"


def pause() -> None:
    """Rank 0 (a node that stalls: its peers then wait in their next collective) stops
    itself, once; the marker holds its pid."""
    if Path(MARKER).exists() or os.environ.get("RANK", "0") != "0":
        return
    Path(MARKER).write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


real_flush = metrics.Reporter.flush


def flush(self, *, show: bool = False):
    if POINT == "metrics" and any(step >= int(STEP) for step, _, _ in self.pending):
        pause()
    return real_flush(self, show=show)


real_save = checkpointing.save


def save(run, step, loader, *, keep):
    if POINT == "save" and step == int(STEP):
        pause()
    return real_save(run, step, loader, keep=keep)


real_run = writer._run


def run(jobs, writing, directories) -> None:
    if POINT == "writing" and directories[0].name.startswith(f".tmp-{STEP_NAME}"):

        def stop() -> dict:
            pause()
            return {}

        jobs = [jobs[0], stop, *jobs[1:]]
    real_run(jobs, writing, directories)


real_rename = os.rename
real_replace = os.replace


def renamed(rename):
    """os.rename or os.replace, paused around the rename of the staging to `step`'s name
    (the publication uses one or the other, before and after the fencing)."""

    def call(src, dst, *args, **kwargs):
        publishing = Path(dst).name == STEP_NAME and Path(src).name.startswith(".tmp-step")
        if POINT == "publish" and publishing:
            pause()
        done = rename(src, dst, *args, **kwargs)
        if POINT == "published" and publishing:
            pause()
        return done

    return call


metrics.Reporter.flush = flush
checkpointing.save = save
writer._run = run
publish.os.rename = renamed(real_rename)  # the module's `os` is the one os: both names
publish.os.replace = renamed(real_replace)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
