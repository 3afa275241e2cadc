"""vocab_parallel_numeric_loss under torchrun (gloo, CPU) against the single-device reference.

The worker (workers/tp_loss.py) checks values, statistics and gradients for every kind and
digit layout in float64 (1e-10) and float32 (1e-5, relative for sums), kind=mle against
megatron-core's vocab_parallel_cross_entropy, the collective counts, and grouped digits (the
unfused and the fused op against the reference and the float64 loop oracle).
"""

from __future__ import annotations

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_reference_with_megatron_group(tp):
    # at TP 2 the explicit group's checks too, first, in the same launch (one start-up)
    modes = ["explicit-group", "reference"] if tp == 2 else ["reference"]
    output = run_torchrun("tp_loss.py", tp, *modes)
    assert f"OK 672 cases on {tp} ranks (reference)" in output
    # grouped digits (1..3 per token), unfused and fused against the reference and the oracle
    assert f"OK 26 grouped cases on {tp} ranks" in output
    if tp == 2:
        # megatron's parallel state not initialized: the caller's group is the one used
        assert "OK 336 cases on 2 ranks (explicit-group)" in output


def test_a_rank_with_no_real_column():
    """Vocabulary 20 padded to 48 at TP 2 (as 100 padded to 256 in the README's example):
    rank 1 owns padding only; the unfused and the fused op still match the reference."""
    output = run_torchrun("tp_empty_shard.py", 2)
    assert "OK 16 cases, rank 1 owning no real column" in output
