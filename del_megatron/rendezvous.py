"""Joining the run's ranks, said aloud: a rank waiting for its peers says what it waits for
(how many ranks, which, where, since when) within seconds and again at intervals, stops in
one line on SIGTERM, SIGINT or SIGUSR1 while it waits, and gives up in one line after
parallel.collective_timeout_minutes. Then the process group is made on the store this
rendezvous used, so torch does not rendezvous a second time.

torch's own env:// rendezvous waits inside C++ (its TCPStore client retries for an hour;
rank 0 waits for the others in the backend's set-up), says nothing and retries a signal's
interrupted system call, so a rank whose peers never started printed one line and then
nothing, and a TERM did nothing. Here every wait is a short step in Python: a TCP connect
to the rendezvous address with a timeout of a second, or a read of the store's count.

Roles: rank 0 serves the store on MASTER_ADDR:MASTER_PORT and the others connect to it, as
torch's env:// does; under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) every rank is a
client of the agent's store, whose keys are kept apart per restart as torch keeps them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from datetime import timedelta

from .errors import UserError

FIRST_SAY_S = 3.0  # the first line about the wait, then at doubling intervals up to LONGEST
LONGEST_SAY_S = 60.0
STEP_S = 1.0  # one connect attempt, or one sleep between reads of the count
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SHOWN = 8  # missing ranks named in a line


class RendezvousTimeout(UserError):
    """The peers did not all come within the timeout; the message says who was missing."""


class StoppedWhileWaiting(Exception):
    """A stop signal arrived while this rank waited for its peers: nothing was trained, the
    process exits (del-train: status 75, the same command starts again)."""


@contextlib.contextmanager
def _signals_stop() -> None:
    """SIGTERM, SIGINT and SIGUSR1 raise StoppedWhileWaiting for the block (the run's own
    handlers, which only record a stop for the next step's agreement, are put back)."""

    def stop(signum, frame):
        raise StoppedWhileWaiting(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in STOPS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Clock:
    """When the wait started, its deadline, and when to say it next."""

    def __init__(self, timeout: timedelta) -> None:
        self.start = time.monotonic()
        self.wall = time.strftime("%H:%M:%S UTC", time.gmtime())
        self.timeout = timeout.total_seconds()
        self.interval = FIRST_SAY_S
        self.next_say = self.start + FIRST_SAY_S

    def waited(self) -> float:
        return time.monotonic() - self.start

    def over(self) -> bool:
        return self.waited() > self.timeout

    def due(self) -> bool:
        if time.monotonic() < self.next_say:
            return False
        self.interval = min(self.interval * 2, LONGEST_SAY_S)
        self.next_say = time.monotonic() + self.interval
        return True

    def since(self) -> str:
        return f"since {self.wall}, {self.waited():.0f} s"


def _say(line: str) -> None:
    print(f"del-train: {line}", file=sys.stderr, flush=True)


def _reachable(host: str, port: int) -> str | None:
    """None when something accepts a connection at host:port, else why not (a phrase)."""
    try:
        with socket.create_connection((host, port), timeout=STEP_S):
            return None
    except socket.gaierror:
        return f"{host} does not resolve"
    except OSError:
        time.sleep(STEP_S / 4)  # refused at once: do not spin
        return "nothing listens there yet"


def _connect(rank: int, world: int, host: str, port: int, clock: _Clock):
    """A client of the store at host:port, once something listens there."""
    import torch.distributed as dist

    where = f"{host}:{port}"
    while True:
        why = _reachable(host, port)
        if why is None:
            try:
                return dist.TCPStore(host, port, world, False, timeout=timedelta(seconds=30))
            except (RuntimeError, OSError) as err:
                why = f"the connection failed ({str(err).splitlines()[0][:120]})"
        if clock.over():
            raise RendezvousTimeout(
                f"rank {rank} of {world}: no rendezvous at {where} within "
                f"{clock.timeout:.0f} s (parallel.collective_timeout_minutes): {why}; check "
                "that rank 0 started and that MASTER_ADDR / MASTER_PORT reach it"
            )
        if clock.due():
            _say(
                f"rank {rank} of {world} waiting for rank 0's rendezvous at {where} "
                f"({clock.since()}): {why}"
            )


def _serve(host: str, world: int, port: int):
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            host,
            port,
            world,
            True,
            timeout=timedelta(seconds=30),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except (RuntimeError, OSError) as err:
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            raise UserError(
                f"rank 0: MASTER_PORT={port} is in use on this host (another job?): choose "
                "another MASTER_PORT"
            ) from None
        raise


def _missing(store, prefix: str, world: int) -> list[int]:
    return [r for r in range(world) if not store.check([f"{prefix}/rank/{r}"])]


def _arrive(store, prefix: str, rank: int, world: int, where: str, clock: _Clock) -> None:
    """Count this rank in and wait until every rank has been counted."""
    store.set(f"{prefix}/rank/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
    store.add(f"{prefix}/arrived", 1)
    while (arrived := store.add(f"{prefix}/arrived", 0)) < world:
        if clock.over() or clock.due():
            missing = _missing(store, prefix, world)
            named = ", ".join(map(str, missing[:SHOWN])) + (", ..." if len(missing) > SHOWN else "")
            what = (
                f"{world - arrived} of {world} rank(s) to join at {where} (missing: rank "
                f"{named}; not started, or not reaching it)"
            )
            if clock.over():
                raise RendezvousTimeout(
                    f"rank {rank} of {world}: waited {clock.timeout:.0f} s "
                    f"(parallel.collective_timeout_minutes) for {what}; start every rank "
                    "(WORLD_SIZE is the number of ranks of the whole job)"
                )
            _say(f"rank {rank} waiting for {what} ({clock.since()})")
        time.sleep(STEP_S / 4)


def join(backend: str, timeout: timedelta, **init_options) -> None:
    """Make the default process group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
    environment) after every rank has arrived; waits at most `timeout`, the collectives'
    timeout too. init_options go to torch.distributed.init_process_group (device_id)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = f"{host}:{port}"
    clock = _Clock(timeout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    with _signals_stop():
        try:
            store = _serve(host, world, port) if rank == 0 and not agent else None
            store = store or _connect(rank, world, host, port, clock)
            if agent:  # torchrun's store outlives a restart of its workers: keep them apart
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                store = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
            _arrive(store, "del-megatron/rendezvous", rank, world, where, clock)
        except StoppedWhileWaiting as stop:
            raise StoppedWhileWaiting(
                f"stopped by {stop} while rank {rank} of {world} waited for its peers at "
                f"{where} ({clock.since()}): nothing trained; the same command starts again"
            ) from None
    store.set_timeout(timeout)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, **init_options
    )


def store_client(timeout: timedelta):
    """A new client of the store `join` used (its keys kept apart per restart under
    torchrun's agent as there), each of its calls waiting at most `timeout`: for a thread
    other than the main one (del_megatron/watchdog.py's heartbeat), whose calls must neither
    share the main thread's connection nor wait the collectives' timeout."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, None, False, timeout=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
    return store
