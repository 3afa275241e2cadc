"""The fused output layer + loss under torchrun (gloo, CPU) against the unfused hook on the
materialized logits: values, statistics and gradients of hidden and the weight shard
(workers/tp_fused.py), at TP 1, 2 and 4, float64 and float32 (and bf16 inputs at TP 2)."""

from __future__ import annotations

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow

CASES = 4 * 2 * 8 * 3  # layouts x vocabulary sizes x kinds x chunk sizes


@pytest.mark.parametrize(
    ("tp", "dtype"),
    [
        (1, "float64"),
        (2, "float64"),
        (4, "float64"),
        (2, "float32"),
        (4, "float32"),
        (2, "bfloat16"),
    ],
)
def test_fused_equals_unfused(tp, dtype):
    output = run_torchrun("tp_fused.py", tp, dtype)
    assert f"OK {CASES} cases on {tp} ranks in torch.{dtype}" in output
