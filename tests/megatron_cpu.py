"""megatron-core's engine on the CPU in tests: the package's shims
(del_megatron/models/megatron_on_cpu.py), applied where no GPU is (a GPU machine runs the
same tests on megatron as it is). Opt-in: a test calls them."""

from __future__ import annotations

import contextlib

import torch

from del_megatron.models import megatron_on_cpu
from del_megatron.models.megatron_on_cpu import MEGATRON_BRIDGE, MEGATRON_LM

__all__ = ["MEGATRON_BRIDGE", "MEGATRON_LM", "run_megatron_on_cpu", "tensor_cuda_stays"]


def run_megatron_on_cpu(*also: str) -> None:
    """megatron_on_cpu.rebind(*also), where CUDA is not available."""
    if not torch.cuda.is_available():
        megatron_on_cpu.rebind(*also)


@contextlib.contextmanager
def tensor_cuda_stays():
    """megatron_on_cpu.tensor_cuda_stays(), where CUDA is not available."""
    if torch.cuda.is_available():
        yield
        return
    with megatron_on_cpu.tensor_cuda_stays():
        yield
