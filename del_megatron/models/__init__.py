"""megatron-core models of the Llama family with the numeric loss hook.

`LlamaArchitecture` (the record) imports no megatron-core; the model, its builder and the
loss function import it on first use, so the run config, the config.json mapping and the
memory plan stay free of it (tests/test_imports.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from .architecture import LlamaArchitecture

# name -> the module defining it: each imports megatron-core
_MEGATRON = {"NumericLossGPTModel": ".gpt", "loss_func": ".gpt", "build_llama": ".llama"}

__all__ = ["LlamaArchitecture", "NumericLossGPTModel", "build_llama", "loss_func"]


def __getattr__(name: str) -> Any:
    if name in _MEGATRON:
        return getattr(importlib.import_module(_MEGATRON[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
