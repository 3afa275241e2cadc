"""Stop requests (preemption, a scheduler's warning) that every rank acts on together.

A signal may reach only some processes: a batch shell's signal forwarded to one node, a
`kill` of one rank. The handler only sets a rank-local flag; after each step the ranks
agree on it (one all-reduce MAX over the world) and the loop branches on the agreed value
alone, so every rank saves the same checkpoint and leaves the loop at the same step. The
same all-reduce carries whether a rank saw a non-finite loss and whether a rank's
checkpoint writer is still writing, so a step has one host synchronisation in all (`agree`).

A rank stuck in a collective runs no Python handler: del_megatron/watchdog.py's thread reads
the signal and ends the rank when the wait has stalled (the step unsaved).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import collectives, watchdog
from ..errors import INTERRUPTED
from ..parallel import launch_rank

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
AGREEMENT = (
    "the step's agreement (an all-reduce of the stop, non-finite and writing flags over every "
    "rank, read on the host)"
)


class StopRequest:
    """Installs handlers for SIGTERM, SIGUSR1 and SIGINT (Ctrl-C: a stop like SIGTERM) until
    `restore()`. A second SIGTERM or SIGUSR1 while the checkpoint is written changes
    nothing, unless that save has stalled (del_megatron/watchdog.py then ends the rank); a
    second Ctrl-C exits at once, in one line and without a traceback (the checkpoint being
    written, if any, is left unpublished: the last complete one is kept)."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal this rank got
        self._pid = os.getpid()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked data worker (a terminal signals them too):
            return  # the rank decides, the worker ends with it
        # os.write, not print: a handler runs between any two bytecodes, print among them
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            _say("interrupted again: exiting now (the last complete checkpoint is kept)")
            for stream in (sys.stdout, sys.stderr):  # what the run printed before, if it can
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(INTERRUPTED)
        if signum == signal.SIGINT:
            _say(
                "interrupted (Ctrl-C): stopping after this step with a checkpoint, then the "
                "same command continues; Ctrl-C again to exit at once"
            )
        if self.received is None or signum == signal.SIGINT:
            self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def _say(line: str) -> None:
    """One line on stderr from the first rank (every rank of a terminal's job gets Ctrl-C)."""
    if launch_rank() == 0:
        os.write(2, f"del-train: {line}\n".encode())


class Agreement(NamedTuple):
    """What every rank decided together after a step."""

    stop: bool  # some rank received a stop signal
    nonfinite: bool  # some rank's loss was not finite
    writing: bool  # some rank's checkpoint writer has not finished
    lost: bool = False  # the output's lock was taken over (rank 0 read its record)


def agree(
    stop: StopRequest | None, nonfinite: torch.Tensor, writing: bool = False, lost: bool = False
) -> Agreement:
    """One all-reduce MAX over the world of [stop signal received, loss not finite, still
    writing a checkpoint, output lock lost] and the step's one host synchronisation
    (collective: every rank calls it at the same point).

    nonfinite: this rank's 0-dim flag, on the compute device (no host copy before the
    reduction: the host flags are filled on the device too). writing: whether this rank's
    checkpoint writer is still at work (checkpoint/writer.py). lost: whether this rank found
    the output's lock taken over (rank 0 reads the lock's record before the step:
    outputs.lock_lost), so every rank stops on it together, with no collective of its own."""
    received = stop is not None and stop.received is not None
    device = nonfinite.device
    flags = torch.stack(
        [
            torch.full((), float(received), device=device),
            nonfinite.double(),
            torch.full((), float(writing), device=device),
            torch.full((), float(lost), device=device),
        ]
    )
    # the rank's watchdog says a wait here (a peer stopped, a device hung) and ends the rank
    # on a stop signal: the handler above cannot run while this thread is in the C++ wait
    with watchdog.waiting(AGREEMENT):
        collectives.all_reduce(flags, op=dist.ReduceOp.MAX)  # the world group
        stop_flag, nonfinite_flag, writing_flag, lost_flag = flags.tolist()
    if stop_flag > 0:  # the run saves now: the signals so far do not cut that save short
        watchdog.stop_agreed()
    return Agreement(
        stop=stop_flag > 0,
        nonfinite=nonfinite_flag > 0,
        writing=writing_flag > 0,
        lost=lost_flag > 0,
    )
