"""Fixtures of the loss tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group (the ops take a tensor-parallel group)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()
