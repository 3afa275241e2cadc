"""2 data-parallel x 2 tensor-parallel ranks x 2 loader workers under torchrun: one epoch
reads each document exactly once per data-parallel group; tensor-parallel peers get
identical batches; every rank the same number of batches."""

from __future__ import annotations

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow


def test_dp2_tp2_workers2_one_epoch(synth_shards):
    output = run_torchrun("data_ranks.py", 4, str(synth_shards))
    assert "OK 600 documents" in output
