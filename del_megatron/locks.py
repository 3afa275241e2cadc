"""Locks that survive their holder: a lock whose holder is provably gone is taken over without
a person, with one line naming it; a live holder's lock never is.

A lock is a file made with an atomic hard link (write the holder's record to a file of our
own, then link it to the lock's name: link fails if the name exists), not fcntl/flock: flock
is not shared between the nodes of many network filesystems (NFS without lockd, Lustre
mounted without flock), so two nodes of a job could both "hold" it, while link(2) is atomic
on NFS and Lustre alike. The record names the holder: host, pid, the process's start time
and the host's boot and pid namespace (so a pid used again, a rebooted node or a container
are not taken for the holder), its SLURM job and restart count, its lease, and a token drawn
at random for this holding (a second holding by the same process, or a lock file under a
reused inode number, has another). The holder renews the lease: a daemon thread touches the
lock (its mtime) every tenth of the lease.

The holder is gone, and the lock taken over, when
* it is a process of this host (same host name, boot and pid namespace) that is not there:
  no such pid, or another process under it (SIGKILL, a crash: no cleanup ran);
* it ran on this host before the host restarted (another boot id);
* it is an earlier run of this same SLURM job (same SLURM_JOB_ID, a lower
  SLURM_RESTART_COUNT): SLURM requeued the job after a node failure or preemption, which it
  does only once that run has ended;
* it is elsewhere (another host, another container) and has not renewed the lock for longer
  than its lease (DEL_LOCK_LEASE_S, default 600 s; the hosts' clocks agreeing within that, as
  NTP keeps them). A lock without a record (one torch made, say) counts from its last change.

Takeover is a move aside and a check that what was moved is the gone holder's lock (another
process may have taken it over meanwhile), so two takers never both hold it.

A holder whose lease ran out (a node that stalled, a paused container, a hung network
filesystem) may wake after its lock was taken over: noticing is not enough, so every writer
asks `check` before it writes (the lock's record, read now, must carry this holding's
token) and stops in one line (`LockLost`) when it does not. How the writers of an output
use it, and what no check on a POSIX filesystem can close: outputs.py, "Fencing".
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .errors import UserError

LEASE_ENV = "DEL_LOCK_LEASE_S"
DEFAULT_LEASE_S = 600.0


def lease_s() -> float:
    """How long a holder elsewhere may go without renewing before its lock is taken over."""
    try:
        return max(float(os.environ.get(LEASE_ENV, DEFAULT_LEASE_S)), 0.5)
    except ValueError:
        return DEFAULT_LEASE_S


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return None


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third (the state) on; None where there is none."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split() if stat and ")" in stat else None


def _started(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22)."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _slurm_restart() -> int:
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def record() -> dict[str, Any]:
    """This process as a lock holder (a fresh `token` each call: one holding's)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": _started(os.getpid()),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": _pid_namespace(),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": _slurm_restart(),
        "lease_s": lease_s(),
        "since": int(time.time()),
        "token": secrets.token_hex(6),
    }


def read_holder(lock: Path) -> dict[str, Any] | None:
    """The lock's holder record; None if there is no lock. A lock that holds no record (an
    empty file torch's build made, a foreign file) is an unknown holder: {}."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict[str, Any]) -> str:
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}"


def _mine(holder: dict[str, Any]) -> bool:
    return holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()


def gone(holder: dict[str, Any], lock: Path) -> str | None:
    """Why the holder of `lock` is provably gone (a clause for the line), or None: it may be
    live (module docstring)."""
    me = record()
    same_host = holder.get("host") == me["host"]
    if same_host and holder.get("boot") and me["boot"] and holder["boot"] != me["boot"]:
        return "which ran before this host restarted"
    pid = holder.get("pid")
    if (
        same_host
        and isinstance(pid, int)
        and holder.get("pid_namespace", me["pid_namespace"]) == me["pid_namespace"]
    ):
        if not _alive(pid, holder.get("started")):
            return "which is gone"
        return None
    job = holder.get("slurm_job")
    if job is not None and job == me["slurm_job"]:
        if int(holder.get("slurm_restart") or 0) < me["slurm_restart"]:
            return (
                f"this job's earlier run (SLURM job {job}, restart "
                f"{holder.get('slurm_restart') or 0}; this is restart {me['slurm_restart']}), "
                "which SLURM requeued"
            )
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    lease = float(holder.get("lease_s") or lease_s())
    if age > lease:
        return f"which has not renewed it for {age:.0f} s (its lease: {lease:.0f} s, {LEASE_ENV})"
    return None


def _alive(pid: int, started: int | None) -> bool:
    """Whether process `pid` of this host is the one that started at `started` (any process
    under that pid when the start time is unknown)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive, perhaps the holder
    fields = _stat(pid)
    if fields and fields[0] in ("Z", "X"):  # exited, not yet reaped by its parent
        return False
    now = _started(pid)
    return started is None or now is None or now == started


def try_take(lock: Path, what: str) -> dict[str, Any] | None:
    """Take `lock` (None) or return its live holder's record. A gone holder's lock is taken
    over with one line on stderr saying whose it was and why (`what`: the thing locked, as
    the line names it). Held locks are renewed until `release`."""
    mine = lock.with_name(f"{lock.name}.{socket.gethostname()}-{os.getpid()}")
    ours = record()
    mine.write_text(json.dumps(ours))
    try:
        while True:
            try:
                os.link(mine, lock)
                _renewer.hold(lock, ours["token"])
                return None
            except FileExistsError:
                pass
            holder = read_holder(lock)
            if holder is None:
                continue  # released between the two calls: try again
            if _mine(holder):
                return None  # ours already (del-eval holds --out, then writes through here)
            why = gone(holder, lock)
            if why is None:
                return holder
            if _move_aside(lock, holder):
                who = describe(holder) if holder else "no holder named in it"
                print(f"{what}: taking over the lock {lock} of {who}, {why}", file=sys.stderr)
    finally:
        mine.unlink()


def _move_aside(lock: Path, holder: dict[str, Any]) -> bool:
    """Remove the gone holder's `lock`, making sure what is removed is that lock (another
    taker may have replaced it meanwhile: then it is put back, unless taken again)."""
    aside = lock.with_name(f"{lock.name}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.replace(lock, aside)
    except FileNotFoundError:
        return False
    try:
        if read_holder(aside) != holder:
            with contextlib.suppress(FileExistsError):
                os.link(aside, lock)
            return False
        return True
    finally:
        aside.unlink()


def release(lock: Path) -> None:
    """Give `lock` back if this process holds it (never another's: not a lock taken over
    from it, even by a later holding of this same process)."""
    token = _renewer.token(lock)
    _renewer.forget(lock)
    holder = read_holder(lock)
    if holder and _mine(holder) and holder.get("token", token) == token:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


class LockLost(UserError):
    """This process's lock was taken over (its lease ran out while the process was stopped
    or cut off): it must write nothing more under what the lock guards. The message is the
    one line it stops with; exit status 2, as for a mistake (not 75, "run me again"): the
    output is another job's now, so a requeue would be refused by that live holder, and
    where this process is an earlier run of the same SLURM job (a node that came back after
    SLURM requeued the job), a requeue from its batch script would requeue, and so end, the
    live run."""


def token(lock: Path) -> str | None:
    """This process's token for `lock` while it holds it (None: it never took it)."""
    return _renewer.token(lock)


def check(lock: Path, what: str) -> str | None:
    """This holding's token, if `lock` on the disk is still this process's; else LockLost,
    naming who holds it now. `what`: the thing locked, as the line names it. One read of the
    lock: a writer calls it right before each write it must not make once taken over. None:
    this process never took `lock` (a library call outside a command), so it has none to
    lose."""
    ours = _renewer.token(lock)
    if ours is None:
        return None
    for _ in range(3):  # {}: a read that failed (a network filesystem's hiccup): again
        holder = read_holder(lock)
        if holder is not None and holder.get("token") == ours:
            return ours
        if holder != {}:
            break
        time.sleep(0.1)
    raise LockLost(taken_over_line(lock, what, holder))


def taken_over_line(lock: Path, what: str, holder: dict | None) -> str:
    """The line a process of a job whose `lock` was taken over stops with, naming its
    `holder` now (`read_holder`'s record; {} unreadable, None none)."""
    if holder is None:
        now = "nobody holds it now"
    elif not holder:
        now = "an unknown holder has it now"
    else:
        now = f"{describe(holder)} holds it now"
    return (
        f"{what}: this process's lock {lock} was taken over ({now}; the lease, "
        f"{lease_s():.0f} s, {LEASE_ENV}, ran out while this process did not run): it "
        "stops without writing anything more there"
    )


class _Renewer:
    """The daemon thread that renews this process's locks (their mtime) every tenth of the
    lease. Process-wide, like the locks it keeps: one thread for all of them. A lock found
    taken over (another file under its name) is no longer renewed; the process's next
    write says so (`check`), in the one line it stops with."""

    def __init__(self) -> None:
        self.held: dict[Path, int] = {}  # lock -> inode of our file
        self.tokens: dict[Path, str] = {}  # lock -> this holding's token, until `release`
        self.guard = threading.Lock()
        self.thread: threading.Thread | None = None

    def hold(self, lock: Path, token: str) -> None:
        with self.guard:
            self.held[lock] = lock.stat().st_ino
            self.tokens[lock] = token
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="lock-lease", daemon=True)
                self.thread.start()

    def drop(self, lock: Path) -> None:
        """No more renewing; the token stays, for `check` to compare (until `release`)."""
        with self.guard:
            self.held.pop(lock, None)

    def token(self, lock: Path) -> str | None:
        with self.guard:
            return self.tokens.get(lock)

    def forget(self, lock: Path) -> None:
        with self.guard:
            self.held.pop(lock, None)
            self.tokens.pop(lock, None)

    def _run(self) -> None:
        while True:
            time.sleep(min(max(lease_s() / 10, 0.1), 60.0))
            with self.guard:
                held = list(self.held.items())
            for lock, inode in held:
                try:
                    if lock.stat().st_ino == inode:
                        os.utime(lock)
                        continue
                except FileNotFoundError:
                    pass
                except OSError:  # a filesystem that refuses now may not later: try again
                    continue
                self.drop(lock)  # taken over: the next `check` says so and stops


_renewer = _Renewer()
