"""How a run tells CUDA to use the device, before the first context: one hardware queue
(CUDA_DEVICE_MAX_CONNECTIONS=1) only where megatron's tensor-parallel layers need it
(tensor parallel > 1; at TP 1 it only serialises the data-parallel reductions the engines
overlap), the allocator's expandable segments, a user's own settings kept. Failed on the
code before: the queue was pinned at every layout and the allocator left as it was
(issue 50, item 11)."""

from __future__ import annotations

import os

import pytest
import torch

from del_megatron.runtime import select_accelerator

NAMES = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "DS_ACCELERATOR")


@pytest.fixture
def clean(monkeypatch):
    for name in NAMES:  # set, then deleted: what the test sets is undone after it
        monkeypatch.setenv(name, "before")
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("tp, pinned", [(1, False), (2, True), (None, True)])
def test_one_queue_only_where_tensor_parallel_needs_it(clean, tp, pinned):
    select_accelerator(torch.device("cuda"), tp)
    assert ("CUDA_DEVICE_MAX_CONNECTIONS" in os.environ) is pinned
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "DS_ACCELERATOR" not in os.environ


def test_a_users_settings_are_kept(clean):
    clean.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    clean.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    select_accelerator(torch.device("cuda"), 2)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
