"""argparse types shared by the command lines (del-train, del-eval, del-convert,
`python -m del_megatron.data`, data-tools): numbers that must be positive are refused with
argparse's one-line usage error (exit status 2) instead of running with them. At the package
root, below `cli/`: a command outside `cli/` takes them without importing the others."""

from __future__ import annotations

import argparse


def _number(kind, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _number(float, text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def progress_bars(quiet: bool) -> bool:
    """Whether a command draws progress bars: not when asked to be quiet, and not when stderr
    is no terminal (a log file or a pipe would keep every redraw of the bar)."""
    import sys

    return not quiet and sys.stderr.isatty()
