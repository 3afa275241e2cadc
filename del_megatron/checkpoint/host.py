"""A save's host copy (the optimizer state's ranges, the buffers, the weights): queued from the
device without the host waiting for it, waited for once before the writer reads it.

A blocking copy from a GPU to pageable host memory (`tensor.to("cpu")`, `.cpu()`) makes the
host wait for the device, once per tensor: a checkpoint of a model's few hundred tensors
(each with a master and two moments) was as many synchronisations on the training thread.
Into page-locked memory a `non_blocking` copy is queued on the stream like any kernel and the
host goes on; `save.save` waits once (`runtime.synchronize`) after every copy of the save is
queued and before the writer thread gets them (it reads them while training goes on: an
unfinished copy would be written as garbage).

On CPU nothing is page-locked (pinning needs CUDA) and a copy is synchronous: the same calls,
plain host memory (tests/distributed/residency.py models the CUDA path on CPU by marking
`host_buffer`'s results page-locked).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def host_buffer(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised host memory for a copy of a tensor of `device`: page-locked on CUDA (a
    `non_blocking` copy into it is asynchronous; into pageable memory CUDA stages it and the
    host waits), plain on CPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def host_copies(
    tensors: Iterable[torch.Tensor], dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """A host copy of each tensor (in `dtype`, else its own; contiguous), queued and NOT
    waited for: read none of them before `runtime.synchronize(device)` (save.save waits once
    for the whole save). `tensors` may be a generator: each is copied as it comes (a ZeRO-3
    parameter inside its gather)."""
    copies = []
    for tensor in tensors:
        # looked up at each call: the residency test marks what it returns (page-locked)
        host = host_buffer(tensor.shape, dtype or tensor.dtype, tensor.device)
        host.copy_(tensor, non_blocking=True)
        copies.append(host)
    return copies
