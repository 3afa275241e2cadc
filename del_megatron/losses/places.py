"""Place values of digits, from target classes alone, vectorized (no loop over positions).

A number is a maximal run of digits in one sequence, optionally with one '.' followed by
more digits. A '.' that follows a decimal run ("3.14.15") ends the number and starts nothing:
the digits after it begin a fresh integer. A '.' with no digit before it opens a decimal
(".5"). Masked positions, sequence edges and document starts (packed documents,
`document_starts`) end numbers (docs/losses.md has the full table).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .vocab import POINT_CLASS


def _prev(x: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """x shifted one step later along the last dim, False entering: x[t-1]; with document
    `starts` [..., s] bool, also False at a document's first position (nothing before it)."""
    before = torch.nn.functional.pad(x[..., :-1], (1, 0))
    return before if starts is None else before & ~starts


def _next(x: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """x[t+1], False past the end; with document `starts`, also False at a document's last
    position (the next one starts another document)."""
    after = torch.nn.functional.pad(x[..., 1:], (0, 1))
    return after if starts is None else after & ~_next(starts)


class NumberRuns(NamedTuple):
    """The run structure of the numbers in target classes, all [..., s]."""

    is_digit: torch.Tensor  # bool
    decimal_run: torch.Tensor  # bool: a digit of a run after a decimal point
    decimal_point: torch.Tensor  # bool: a '.' that belongs to a number
    last_non_digit: torch.Tensor  # long: position of the latest non-digit at or before t (-1)
    next_non_digit: torch.Tensor  # long: position of the next non-digit at or after t (s)


def number_runs(classes: torch.Tensor, document_starts: torch.Tensor | None = None) -> NumberRuns:
    """Numbers of `classes` [..., s] (0..9 digits, POINT_CLASS, negative otherwise): shared
    by the places of single-digit tokens (`digit_places`) and of grouped number tokens
    (`groups.grouped_places`, where a number token's class is any digit).

    document_starts: [..., s] bool, True at the first position of each document of a packed
    row (`documents.document_starts_of`), or None (one document per row): a document start
    is read as a row start, so no number (nor its '.' links) crosses it."""
    starts = document_starts
    is_digit = (classes >= 0) & (classes <= 9)
    is_point = classes == POINT_CLASS
    digit_before, digit_after = _prev(is_digit, starts), _next(is_digit, starts)

    run_start = is_digit & ~digit_before
    link = is_point & digit_before & digit_after  # '.' between two digit runs
    lead = is_point & ~digit_before & digit_after  # ".5"
    # Runs joined by single '.' form a chain; within a chain decimal and integer runs alternate
    # ("1.2.3.4" reads 1.2 and 3.4), starting with a decimal run after a leading '.'.
    chain_start = run_start & ~_prev(link, starts)
    run_number = torch.cumsum(run_start.long(), dim=-1)
    # cummax carries the latest chain start forward; run_number grows, so the code does too.
    code = torch.where(chain_start, 2 * run_number + _prev(lead, starts).long(), 0)
    code = torch.cummax(code, dim=-1).values
    run_in_chain = run_number - code // 2
    decimal_run = is_digit & ((run_in_chain + code % 2) % 2 == 1)

    pos = torch.arange(classes.shape[-1], device=classes.device).expand_as(classes)
    end = classes.shape[-1]
    digit_mark, digit_end_mark = -1, end
    if starts is not None:
        # a document's edges count as non-digits just outside it: one before its first
        # position (as -1 is for a row), one after its last (as `end` is for a row)
        digit_mark = torch.where(starts, pos - 1, -1)
        digit_end_mark = torch.where(_next(starts), pos + 1, end)
    last_non_digit = torch.cummax(torch.where(is_digit, digit_mark, pos), dim=-1).values
    next_non_digit = (
        torch.where(is_digit, digit_end_mark, pos).flip(-1).cummin(dim=-1).values.flip(-1)
    )
    decimal_point = is_point & _next(decimal_run, starts)
    return NumberRuns(is_digit, decimal_run, decimal_point, last_non_digit, next_non_digit)


def digit_places(
    classes: torch.Tensor, document_starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place of every digit and the decimal points that belong to numbers.

    classes: [..., s] long: 0..9 digits, POINT_CLASS for '.', anything else (negative) for
    other or masked targets; the last dim is the sequence. document_starts: [..., s] bool or
    None, see `number_runs`.
    Returns place [..., s] long (power of ten of each digit, 0 elsewhere) and
    decimal_point [..., s] bool.
    """
    runs = number_runs(classes, document_starts)
    pos = torch.arange(classes.shape[-1], device=classes.device).expand_as(classes)
    place = torch.where(runs.decimal_run, runs.last_non_digit - pos, runs.next_non_digit - 1 - pos)
    place = torch.where(runs.is_digit, place, 0)
    return place, runs.decimal_point


def place_weights(
    place: torch.Tensor, slope: float, decimal_base: float, dtype: torch.dtype
) -> torch.Tensor:
    """u(i): slope*(i+1) for integer places i >= 0, decimal_base**(i-1) for decimals."""
    p = place.to(dtype)
    return torch.where(place >= 0, slope * (p + 1), torch.pow(decimal_base, p - 1))
