"""Every wait of a training rank said, and stoppable, also mid-training (issue 52): a
collective or host read that has not returned after `parallel.stall_seconds` is said (which
operation, since when, which peers and what they do), again at doubling intervals; a stop
signal (SIGTERM, SIGUSR1, Ctrl-C) during such a stall ends the rank at once in one line,
the step unsaved: exit 75 where a checkpoint exists to continue from, else 1.

Why a thread: a rank blocked in a gloo or NCCL collective, or in a host read of a device
value, sits in C++ until the process group's timeout (`parallel.collective_timeout_minutes`,
up to an hour) and Python runs no signal handler there: the run's own handler
(training/signals.StopRequest, which records a stop for the next step's agreement) never
runs. Python's C-level handler still writes the signal's number to the wakeup fd
(`signal.set_wakeup_fd`), which this watchdog's thread reads.

What it watches: the operations the run marks with `waiting(name)` (the training step, the
step's agreement, a checkpoint's save and publish, each held-out batch group) and every
collective of del_megatron/collectives.py (each marked with its caller: the checkpoint's
barriers and gathers). Each is a push and a pop of a host-side record: no device work, no
synchronisation. A forked data worker forgets the wakeup fd (its signals are its own).

A stall is an operation open for longer than its threshold: `parallel.stall_seconds`, or 3x
the operation's previous duration on this rank if longer (a step that takes 100 s at 7B is
not a stall at 60 s; its first occurrence, compilation included, is said once it passes the
setting). A stop signal while no operation has stalled is the run's ordinary stop (the step
ends, every rank agrees, the checkpoint is saved); one during a stall, or a stall after one,
ends the rank. Once every rank agreed on a stop (`stop_agreed`), the checkpoint it saves is
not cut short by the signal that asked for it: only a new one ends a stall then.

Which peers: every rank's heartbeat thread writes a counter with its host, pid and current
operation to the rendezvous store every beat (`beat_seconds`); a rank whose operation is
stalling reads its peers' (the operation's group, or every rank). A peer whose counter has
not moved for `LIFELESS_BEATS` beats is named "no sign of life" (stopped, its node stalled, or
gone); a store that does not answer names its server (rank 0, or torchrun's agent).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

STOPS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
HISTORY = 3.0  # a stall: longer than this many times the operation's previous duration
LONGEST_SAY_S = 300.0  # the intervals between lines double up to this (or the threshold)
LIFELESS_BEATS = 3  # a peer's counter unchanged this many beats: no sign of life
SHOWN = 8  # peers named in a line
STEP_OPERATION = "the training step's collectives (forward, backward, optimizer)"
EXIT_STOPPED = 75  # cli/train.EXIT_STOPPED: the same command continues (the library's copy)
KEY = "del-megatron/watchdog"


def beat_seconds(stall_s: float) -> float:
    """How often a rank's heartbeat is written (and its peers' read during a stall): six
    beats within a threshold, at most every 5 s (1000 ranks: 200 small writes a second)."""
    return min(stall_s / 6, 5.0)


@dataclass(eq=False)  # one is removed by identity: two can have equal fields
class Operation:
    """One open operation: what it is, the group it waits on (None: every rank), since when."""

    name: str
    of: str  # what it belongs to ("step 6"), said after the name; not part of its history key
    group: Any
    started: float  # time.monotonic()
    wall: float  # time.time(), formatted only when said
    threshold: float

    def text(self) -> str:
        return f"{self.name} of {self.of}" if self.of else self.name


@dataclass
class _Peer:
    said: str  # the last value read: "<count> <host> <pid> <operation>"
    since: float  # when that value was first read (this rank's clock)


@dataclass
class Watchdog:
    """This rank's open operations (pushed and popped by the main thread), what its threads
    learnt (peers' heartbeats, the store's last answer, a stop signal), and the two threads'
    loops (`watch`, `beat`)."""

    rank: int
    world: int
    stall_s: float
    continues_from: Callable[[], Any]  # the checkpoint the same command continues from, or None
    lock: threading.Lock = field(default_factory=threading.Lock)
    open: list[Operation] = field(default_factory=list)  # innermost last (main thread's)
    last: dict[str, float] = field(default_factory=dict)  # an operation's previous duration
    peers: dict[int, _Peer] = field(default_factory=dict)
    store_answered: float = field(default_factory=time.monotonic)  # last store round trip
    store_error: str = ""
    stop: int | None = None  # the first stop signal the thread read
    closing: threading.Event = field(default_factory=threading.Event)

    # ---- the main thread's side: one push and one pop per operation ----

    @contextlib.contextmanager
    def operation(self, name: str, group: Any = None, of: str = "") -> Iterator[None]:
        now = time.monotonic()
        threshold = max(self.stall_s, HISTORY * self.last.get(name, 0.0))
        op = Operation(name, of, group, now, time.time(), threshold)
        with self.lock:
            self.open.append(op)
        try:
            yield
        finally:
            with self.lock:
                self.open.remove(op)
                self.last[name] = time.monotonic() - now

    # ---- the watchdog thread ----

    def stalled(self) -> tuple[Operation, Operation] | None:
        """(the innermost open operation, the one that passed its threshold), or None."""
        now = time.monotonic()
        with self.lock:
            ops = list(self.open)
        over = [op for op in ops if now - op.started >= op.threshold]
        return (ops[-1], over[0]) if over else None

    def watch(self, wakeup: int) -> None:
        tick = min(0.5, beat_seconds(self.stall_s))
        said_for: Operation | None = None
        next_say, interval = 0.0, 0.0
        while not self.closing.is_set():
            ready, _, _ = select.select([wakeup], [], [], tick)
            if ready:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    for signum in os.read(wakeup, 64):
                        if signum in STOPS and self.stop is None:
                            self.stop = signum
            stalled = self.stalled()
            if stalled is None:
                said_for = None
                continue
            inner, over = stalled
            if self.stop is not None:
                self.end(inner)
            now = time.monotonic()
            if said_for is not over:  # a new stall: say it now
                said_for, interval, next_say = over, over.threshold, now
            if now >= next_say:
                _say(self.stall_line(inner, over))
                interval = min(interval * 2, max(LONGEST_SAY_S, over.threshold))
                next_say = now + interval

    def where(self) -> str:
        return f"rank {self.rank} of {self.world} (host {socket.gethostname()}, pid {os.getpid()})"

    def stall_line(self, inner: Operation, over: Operation) -> str:
        now = time.monotonic()
        waited = now - inner.started
        within = [f"{op.text()}, open {_s(now - op.started)}" for op in self.open_outer(inner)]
        context = f" (within {'; '.join(within)})" if within else ""
        return (
            f"{self.where()} waiting {_s(waited)} (since {_clock(inner.wall)}) in {inner.text()}"
            f"{context}: {self.peers_text(inner)}; waited over {_s(over.threshold)} "
            "(parallel.stall_seconds, or 3x its last time): SIGTERM or SIGUSR1 now ends this "
            "rank, the step unsaved"
        )

    def open_outer(self, inner: Operation) -> list[Operation]:
        with self.lock:
            return [op for op in reversed(self.open) if op is not inner]

    def peers_text(self, inner: Operation) -> str:
        """Which peers the operation waits for and what is known of them, in a phrase."""
        if self.world == 1:
            return "no peers (a host read of a device value: the device has not finished)"
        now, beat = time.monotonic(), beat_seconds(self.stall_s)
        silent = now - self.store_answered
        if silent >= LIFELESS_BEATS * beat:
            return (
                f"the rendezvous store ({store_server()}) has not answered for {_s(silent)} "
                f"({self.store_error or 'no reply'}): its host is stopped, stalled or unreachable"
            )
        ranks = [r for r in group_ranks(inner.group, self.world) if r != self.rank]
        with self.lock:
            peers = {r: self.peers.get(r) for r in ranks}
        lifeless, elsewhere, unknown = [], [], []
        for r, peer in peers.items():
            if peer is None:
                unknown.append(r)
                continue
            _, host, pid, doing = [*peer.said.split(" ", 3), "", "", ""][:4]
            still = now - peer.since
            if still >= LIFELESS_BEATS * beat:
                lifeless.append(
                    f"rank {r} (host {host}, pid {pid}; last in {doing}): no sign of life for "
                    f"{_s(still)} (stopped, its node stalled, or gone)"
                )
            elif doing != inner.text():
                elsewhere.append(f"rank {r} (host {host}) in {doing}")
        parts = lifeless[:SHOWN] + elsewhere[: max(0, SHOWN - len(lifeless))]
        if len(lifeless) + len(elsewhere) > SHOWN:
            parts.append(f"and {len(lifeless) + len(elsewhere) - SHOWN} more")
        if unknown:
            parts.append(f"no heartbeat read yet from rank(s) {_ranks_text(unknown)}")
        whom = f"waits for rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}"
        if not parts:
            return f"{whom}, {'every one ' if len(ranks) > 1 else ''}alive and in it too"
        return f"{whom}: " + "; ".join(parts)

    def end(self, inner: Operation) -> None:
        """One line, then exit: 75 where a checkpoint exists to continue from, else 1."""
        name = signal.Signals(self.stop).name
        waited = time.monotonic() - inner.started
        try:
            found = self.continues_from()
        except Exception as err:  # the exit must not wait on a bug here
            found, why = None, f" (looking for one failed: {err})"
        else:
            why = ""
        if found is not None:
            then, code = f"the same command continues from {found}", EXIT_STOPPED
        else:
            then, code = f"no checkpoint to continue from{why}", 1
        with self.lock:
            step = next((op.of for op in self.open if op.of.startswith("step ")), "")
        line = (
            f"stopped by {name} while {self.where()} waited {_s(waited)} in {inner.text()} "
            f"({self.peers_text(inner)}): {step or 'the step in progress'} unsaved; {then}"
        )
        _say(line)
        _flush_and_exit(code)

    # ---- the heartbeat thread ----

    def beat(self) -> None:
        """Every beat: this rank's counter, host, pid and operation to the store; during a
        stall-to-be (an operation open for half its threshold), its peers' too."""
        from . import rendezvous

        beat = beat_seconds(self.stall_s)
        store, count = None, 0
        host, pid = socket.gethostname(), os.getpid()
        while not self.closing.wait(0 if count == 0 else beat):
            count += 1
            try:
                if store is None:
                    store = rendezvous.store_client(timedelta(seconds=max(2 * beat, 1.0)))
                with self.lock:
                    doing = self.open[-1].text() if self.open else "between operations"
                store.set(f"{KEY}/{self.rank}", f"{count} {host} {pid} {doing}")
                self.store_answered = time.monotonic()
                self.read_peers(store)
            except Exception as err:  # a store that does not answer is said
                self.store_error = " ".join(str(err).split())[:120]

    def read_peers(self, store) -> None:
        now = time.monotonic()
        with self.lock:
            ops = list(self.open)
        if not any(now - op.started >= op.threshold / 2 for op in ops):
            return
        ranks = [r for r in group_ranks(ops[-1].group, self.world) if r != self.rank]
        keys = [f"{KEY}/{r}" for r in ranks]
        # a missing key would block a get: one check of them all, one by one only if needed
        if keys and store.check(keys):
            present = ranks
        else:
            present = [r for r, k in zip(ranks, keys, strict=True) if store.check([k])]
        values = store.multi_get([f"{KEY}/{r}" for r in present]) if present else []
        self.store_answered = time.monotonic()
        with self.lock:
            for r, value in zip(present, values, strict=True):
                said = value.decode(errors="replace")
                peer = self.peers.get(r)
                if peer is None or peer.said != said:
                    self.peers[r] = _Peer(said, time.monotonic())


def group_ranks(group: Any, world: int) -> list[int]:
    """The global ranks of `group` (None: every rank)."""
    if group is None:
        return list(range(world))
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(wall))


def _s(seconds: float) -> str:
    """Seconds as a line says them: tenths below 10 s (a short stall_seconds, in tests)."""
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def _ranks_text(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:SHOWN])) + (", ..." if len(ranks) > SHOWN else "")


def store_server() -> str:
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"torchrun's agent at {where}"
    return f"rank 0's, at {where}"


def _say(line: str) -> None:
    # os.write: the main thread may hold sys.stderr's lock while it is stuck
    os.write(2, f"del-train: {line}\n".encode())


def _flush_and_exit(code: int) -> None:
    """What the run printed before, if it can be flushed within a second (the main thread,
    stuck, may hold a stream's lock), then the process ends without unwinding (the main
    thread cannot be unwound from inside a collective)."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    flusher = threading.Thread(target=flush, daemon=True)
    flusher.start()
    flusher.join(timeout=1.0)
    os._exit(code)


# ---- the process's watchdog: what the marks below report to ----

# One per process, as signals are: the marks sit in library code (collectives.py,
# signals.agree) that is handed no run, and are no-ops without a watchdog.
_ACTIVE: Watchdog | None = None


def waiting(name: str, group: Any = None, of: str = ""):
    """Around an operation that may wait for peers or the device: `name` in words ("the
    step's agreement ..."), `group` the process group it waits on (None: every rank), `of`
    what it belongs to ("step 6")."""
    watchdog = _ACTIVE
    if watchdog is None:
        return contextlib.nullcontext()
    return watchdog.operation(name, group, of)


def collective(kind: str, group: Any):
    """Around one of collectives.py's calls, named by kind and its caller
    ('all_gather_object over every rank from checkpoint/publish.py:publish')."""
    watchdog = _ACTIVE
    if watchdog is None:
        return contextlib.nullcontext()
    code = sys._getframe(2).f_code  # 0: here, 1: the collectives function, 2: its caller
    path = Path(code.co_filename)
    over = "every rank" if group is None else "its group"
    return watchdog.operation(
        f"{kind} over {over} from {path.parent.name}/{path.name}:{code.co_name}", group
    )


def stop_agreed() -> None:
    """Every rank agreed on a stop (training/signals.agree) and the run acts on it: saves the
    step's checkpoint, however long that takes. The stops read so far are spent; a new one
    during a stall (a second SIGTERM, the scheduler's last word) still ends the rank."""
    watchdog = _ACTIVE
    if watchdog is not None:
        watchdog.stop = None


_FORK_HOOKED = False


def _child_forgets_the_wakeup_fd() -> None:
    """A forked data worker must not report its own signals to its parent's watchdog."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)


@contextlib.contextmanager
def watching(
    *, rank: int, world: int, stall_s: float, continues_from: Callable[[], Any]
) -> Iterator[Watchdog]:
    """The watchdog of this rank, for the block (the main thread, with the run's stop
    handlers installed: training/signals.StopRequest; they are what makes Python write the
    signal to the wakeup fd). continues_from: the checkpoint a stop's exit continues from
    (None: none, exit 1)."""
    global _ACTIVE, _FORK_HOOKED
    watchdog = Watchdog(rank=rank, world=world, stall_s=stall_s, continues_from=continues_from)
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if not _FORK_HOOKED:
        os.register_at_fork(after_in_child=_child_forgets_the_wakeup_fd)
        _FORK_HOOKED = True
    threads = [threading.Thread(target=watchdog.watch, args=(read,), name="watchdog", daemon=True)]
    if world > 1:
        threads.append(threading.Thread(target=watchdog.beat, name="heartbeat", daemon=True))
    _ACTIVE = watchdog
    for thread in threads:
        thread.start()
    try:
        yield watchdog
    finally:
        _ACTIVE = None
        watchdog.closing.set()
        signal.set_wakeup_fd(previous)
        # within a tick; the heartbeat within its store call's timeout: a thread still in
        # C++ when the interpreter finalizes can abort the process (parallel.end_distributed)
        threads[0].join()
        if len(threads) > 1:
            threads[1].join(timeout=2 * max(2 * beat_seconds(stall_s), 1.0))
        os.close(read)
        os.close(write)
