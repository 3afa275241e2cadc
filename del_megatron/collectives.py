"""The one rule for the collectives the project issues itself (megatron-core and DeepSpeed
issue their own): a tensor handed to a process group lives on a device that group's backend
takes, and it is checked here before the call rather than refused by NCCL on the first GPU run.

Decision (docs/architecture.md, "GPU path"): one backend per run, NCCL on GPU and gloo on CPU,
and everything we reduce (token counts, metrics, stop flags) stays on the compute device. A
dual `cpu:gloo,cuda:nccl` group would let host tensors through, but gloo across nodes needs
its own interface settings on clusters (GLOO_SOCKET_IFNAME) and every host tensor is a copy
and a synchronisation the step does not need.

Every function takes the group explicitly (None: the default world group) and calls
`check_device` first; tests wrap that one function to watch every collective. Each call is
marked for the rank's watchdog (del_megatron/watchdog.py: a collective that does not return
is said, named by its caller, and a stop signal during it ends the rank).

A one-process group skips the call (nothing to communicate), so a run on one GPU would hand
NCCL none of our tensors. `DEL_COLLECTIVES_ON_ONE_RANK=1` in the environment issues every
call on one-process groups too: the GPU acceptance run on one GPU sets it, so NCCL sees the
device, dtype and shape of each tensor we reduce.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from . import watchdog

# the device types each backend takes tensors on (torch's own backends)
BACKEND_DEVICES = {
    "nccl": ("cuda",),
    "gloo": ("cpu",),
    "mpi": ("cpu", "cuda"),
    "ucc": ("cpu", "cuda"),
    "xccl": ("xpu",),
}


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective on a device its group's backend does not take: a bug
    of ours (the tensor should have been made on the compute device)."""


def backend_devices(group: dist.ProcessGroup | None) -> tuple[str, ...]:
    """Device types the backend(s) of `group` take: 'nccl' -> ('cuda',); a multi-device
    backend string such as 'cpu:gloo,cuda:nccl' -> ('cpu', 'cuda')."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return tuple(pair.split(":")[0] for pair in backend.split(","))
    return BACKEND_DEVICES.get(backend, ("cpu", "cuda"))


def check_device(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> None:
    """Refuse, naming the collective, a tensor its group's backend cannot take."""
    allowed = backend_devices(group)
    if tensor.device.type not in allowed:
        raise CollectiveDeviceError(
            f"{what}: a {tensor.device.type} tensor handed to a {dist.get_backend(group)} "
            f"group, which takes {'/'.join(allowed)} tensors only; make it on the compute device"
        )


ON_ONE_RANK = "DEL_COLLECTIVES_ON_ONE_RANK"
"""The switch (environment variable, '1': on) that issues collectives on one-process groups."""


def _alone(group: dist.ProcessGroup | None) -> bool:
    """Whether to skip the call: no process group, or one process without the switch."""
    if not dist.is_initialized():
        return True
    return dist.get_world_size(group) == 1 and os.environ.get(ON_ONE_RANK) != "1"


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """In place over `group`; returns `tensor`. A no-op in a one-process group (or without
    torch.distributed), after the device check, so a CPU test of one process still sees a
    tensor on the wrong device."""
    if dist.is_initialized():
        check_device(tensor, group, "all_reduce")
    if not _alone(group):
        with watchdog.collective("all_reduce", group):
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's `tensor` (same shape on every rank), in rank order."""
    if dist.is_initialized():
        check_device(tensor, group, "all_gather")
    if _alone(group):
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    with watchdog.collective("all_gather", group):
        dist.all_gather(parts, tensor, group=group)
    return parts


def all_gather_object(obj: Any, *, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's picklable `obj`, in rank order. On NCCL, torch stages the pickles on the
    current CUDA device (set per rank by parallel.bind_local_device)."""
    if _alone(group):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with watchdog.collective("all_gather_object", group):
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def gather_object(obj: Any, *, group: dist.ProcessGroup | None = None) -> list | None:
    """Every rank's picklable `obj`, in rank order, on the group's first rank (None on the
    others): what one rank writes, without a copy on every rank. On NCCL, torch stages the
    pickles on the current CUDA device, as all_gather_object."""
    if _alone(group):
        return [obj]
    first = dist.get_rank(group) == 0
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if first else None
    # dst as a global rank: group_dst came with torch 2.6, pyproject admits 2.4
    dst = 0 if group is None else dist.get_global_rank(group, 0)
    with watchdog.collective("gather_object", group):
        dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered


def broadcast_object(obj: Any, *, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Global rank `src`'s picklable `obj` on every rank of `group` (staged on the current
    CUDA device on NCCL, as all_gather_object)."""
    if _alone(group):
        return obj
    sent = [obj]
    with watchdog.collective("broadcast_object", group):
        dist.broadcast_object_list(sent, src=src, group=group)
    return sent[0]


def barrier(*, group: dist.ProcessGroup | None = None) -> None:
    if not _alone(group):
        with watchdog.collective("barrier", group):
            dist.barrier(group=group)
