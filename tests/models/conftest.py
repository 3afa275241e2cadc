"""Fixtures of the model tests."""

from __future__ import annotations

import pytest
import torch

from tests.utils import end_process_group


@pytest.fixture
def cuda_on_cpu(monkeypatch):
    """The few CUDA calls megatron's GPU code paths make, answered by the CPU, so that those
    paths run here: `torch.cuda.current_device()` is "cpu" (where megatron allocates weights
    and its global memory buffer), the CPU generator stands in for the CUDA generator (so
    the RNG tracker's fork really switches the generator drawn from), and the default causal
    mask (made with device="cuda") is made on the CPU. Megatron's RNG tracker starts and ends
    unseeded, as a fresh process has it."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as megatron_random

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "manual_seed", torch.manual_seed)
    for module in (torch.cuda, torch.cuda.random):
        monkeypatch.setattr(module, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    monkeypatch.setattr(
        megatron_random, "_set_cuda_rng_state", lambda state, *_, **__: torch.set_rng_state(state)
    )
    monkeypatch.setattr(
        fused_softmax,
        "get_default_causal_mask",
        lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1),
    )
    megatron_random.get_cuda_rng_tracker().reset()
    yield
    megatron_random.get_cuda_rng_tracker().reset()


@pytest.fixture
def one_process_groups():
    """A one-process gloo group and megatron's parallel state at TP 1 (as del-eval makes
    them), taken down afterwards if this fixture made them."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from del_megatron.evaluation.backends import _single_process_groups

    started = not dist.is_initialized(), not parallel_state.model_parallel_is_initialized()
    _single_process_groups(torch.device("cpu"))
    yield
    if started[1]:
        parallel_state.destroy_model_parallel()
    if started[0]:
        end_process_group()
