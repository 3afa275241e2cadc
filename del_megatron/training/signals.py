"""Stop requests (preemption, a scheduler's warning) that every rank acts on together.

A signal may reach only some processes: a batch shell's signal forwarded to one node, a
`kill` of one rank. The handler only sets a rank-local flag; after each step the ranks
agree on it (one all-reduce MAX over the world) and the loop branches on the agreed value
alone, so every rank saves the same checkpoint and leaves the loop at the same step.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Installs handlers for SIGTERM and SIGUSR1 until `restore()`. A second signal while
    the checkpoint is written changes nothing."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal this rank got
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank received a stop signal (collective: call it on
        every rank at the same point of the loop)."""
        flag = torch.tensor([0.0 if self.received is None else 1.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
