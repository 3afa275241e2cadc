"""Packed documents at TP 2 and TP 4 (gloo, CPU): on vocabulary shards, the unfused and the
fused op give a packed row with `document_starts` exactly what its documents give as rows, and
what the single-device reference gives with the same starts (workers/packed_documents.py)."""

from __future__ import annotations

import pytest

from .launcher import run_torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp", [2, 4])
def test_packed_documents_on_vocabulary_shards(tp):
    output = run_torchrun("packed_documents.py", tp)
    # 7 digit-term configurations and grouped digits, each unfused and fused
    assert f"OK 16 packed-document cases on {tp} ranks" in output
