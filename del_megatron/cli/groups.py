"""The end of a command's process groups, before it returns its exit status."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def _alive() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: no group made (torch neither)
    return dist is not None and dist.is_initialized()


@contextlib.contextmanager
def ended_on_return() -> Iterator[None]:
    """The groups made inside the block, destroyed when it is left without an exception
    (`parallel.end_distributed`: a gloo group alive as the interpreter ends can turn the exit
    status into SIGABRT; NCCL asks for it on every exit). Groups that were there before
    (a caller's) are left to it; on an exception (a traceback: a collective may be pending
    on another rank's behalf) nothing is done. Nothing is imported where no group was made:
    `--help` and a refused command stay quick."""
    before = _alive()
    yield
    if not before and _alive():
        from ..parallel import end_distributed

        end_distributed()
