"""The fused output layer + loss under torchrun (gloo, CPU) against the unfused hook on the
materialized logits: values, statistics and gradients of hidden and the weight shard
(workers/tp_fused.py), at TP 1, 2 and 4, float64 and float32 (and bf16 inputs at TP 2). One
launch per TP size checks each of its dtypes in turn: one start-up (imports, the process
group) per size, not per dtype."""

from __future__ import annotations

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow

CASES = 4 * 2 * 8 * 3  # layouts x vocabulary sizes x kinds x chunk sizes
DTYPES = {
    1: ["float64"],
    2: ["float64", "float32", "bfloat16"],
    4: ["float64", "float32"],
}


@pytest.mark.parametrize("tp", sorted(DTYPES))
def test_fused_equals_unfused(tp):
    output = run_torchrun("tp_fused.py", tp, *DTYPES[tp])
    for dtype in DTYPES[tp]:
        assert f"OK {CASES} cases on {tp} ranks in torch.{dtype}" in output
