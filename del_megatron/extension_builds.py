"""torch's extension builds (torch.utils.cpp_extension.load, which DeepSpeed's op builders
call: its shared-memory all-reduce is built at every CPU start) under a lock that survives
its holder (del_megatron/locks.py).

torch serialises a build with a `lock` file in the extension's build directory
(TORCH_EXTENSIONS_DIR/NAME/lock, made with O_EXCL, empty) and waits while it exists, forever:
a build killed midway (SIGKILL, a node lost) left every later start waiting in "building the
model" until a person removed it (docs/log.md). `install` makes torch's build use our lock
instead: the lock names its holder and is renewed, a holder that is gone (the same rules as
the output lock's) is taken over with one line, a live one is waited for with a line saying
whose build it is, within seconds and at intervals. A holder that dies while this process
waits is taken over and the build run again here. A lock left by plain torch (no record) is
taken over once older than the lease (DEL_LOCK_LEASE_S).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

from . import locks

FIRST_SAY_S = 5.0  # the first line about a build being waited for, then every SAY_EVERY_S
SAY_EVERY_S = 60.0


class _HolderGone(Exception):
    """The build this process waited for ended without finishing: build it here."""


class LeasedBaton:
    """torch.utils.file_baton.FileBaton's interface (try_acquire, wait, release) on a lock of
    del_megatron/locks.py."""

    def __init__(self, lock_file_path, wait_seconds: float = 0.1, warn_after_seconds=None):
        self.lock = Path(lock_file_path)
        self.wait_seconds = wait_seconds
        self.what = f"torch extension build {self.lock.parent}"

    def try_acquire(self) -> bool:
        return locks.try_take(self.lock, self.what) is None

    def wait(self) -> None:
        """Until the holder releases the lock; a holder found gone meanwhile: its lock taken
        over and the build run again by this process (`_HolderGone`, caught by `load`)."""
        started = time.monotonic()
        next_say = started + FIRST_SAY_S
        while True:
            holder = locks.read_holder(self.lock)
            if holder is None:
                return
            if locks.gone(holder, self.lock) is not None:
                if locks.try_take(self.lock, self.what) is None:  # said in one line
                    locks.release(self.lock)
                    raise _HolderGone
                continue
            if time.monotonic() >= next_say:
                waited = time.monotonic() - started
                who = locks.describe(holder) if holder else "a process that names no holder"
                print(
                    f"{self.what}: waiting {waited:.0f} s for the build by {who} (its lock "
                    f"{self.lock})",
                    file=sys.stderr,
                    flush=True,
                )
                next_say += SAY_EVERY_S
            time.sleep(self.wait_seconds)

    def release(self) -> None:
        locks.release(self.lock)


def install() -> None:
    """torch's extension builds on `LeasedBaton`, in this process (idempotent): before
    anything of ours that may build one (DeepSpeed's start: parallel.init_distributed)."""
    from torch.utils import cpp_extension

    if cpp_extension.FileBaton is LeasedBaton:
        return
    cpp_extension.FileBaton = LeasedBaton
    original = cpp_extension.load

    @functools.wraps(original)
    def load(*args, **kwargs):
        while True:
            try:
                return original(*args, **kwargs)
            except _HolderGone:  # the lock is ours to take now: build it here
                continue

    cpp_extension.load = load
