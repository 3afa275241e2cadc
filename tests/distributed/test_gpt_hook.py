"""A Llama-style megatron-core GPTModel with the numeric loss hook at TP = 2 has the
gradients of the same weights at TP = 1 (CPU, gloo, float32, 1e-5)."""

from __future__ import annotations

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["del", "emo"])
def test_tp2_gradients_equal_tp1(kind):
    output = run_torchrun("tp_gpt.py", 2, kind)
    assert f"OK 17 parameter gradients, kind={kind}" in output
