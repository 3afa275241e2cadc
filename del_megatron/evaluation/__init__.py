"""Evaluation: the teacher-forced loop (`pipeline`, shared with the trainer), numeric metrics,
generation accuracy, lm-evaluation-harness, comparison and reports (`del-eval`)."""

from __future__ import annotations

import importlib
from typing import Any

# Imported when first used: the loop needs torch and megatron-core (seconds), which
# `del-eval --help` and del-eval's argument checks must not wait for.
_LAZY = {
    "batch_statistics": "numeric",
    "numeric_metrics": "numeric",
    "Evaluated": "pipeline",
    "teacher_forced": "pipeline",
}

__all__ = ["Evaluated", "batch_statistics", "numeric_metrics", "teacher_forced"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
