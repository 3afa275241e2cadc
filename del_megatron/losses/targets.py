"""The record of what the loss needs to know of the labels (`Targets`, with `SlotSets` for
grouped digits): made by `assemble.prepare_targets` (single digits) or
`groups.grouped_targets` (grouped digits), read by the ops and `assemble`. Its own module,
below both makers, so that neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class SlotSets(NamedTuple):
    """Which set logits each digit slot needs: offset [N, m] (its first set among the S), and
    the sets' members as positions among the number tokens, members [S, W] long with valid
    [S, W] bool (`DigitVocab.slot_sets`)."""

    offset: torch.Tensor
    members: torch.Tensor
    valid: torch.Tensor


@dataclass(frozen=True)
class Targets:
    """What the loss needs to know of the labels, flattened to N = labels.numel() rows.

    Digit positions are a mask over every row, not a list of rows: selecting them would give
    a tensor whose size depends on the data, which a GPU can only tell the host by waiting
    for it (`nonzero`), once per micro-batch. The digit terms run on every row's [N, K] class
    logits instead, weighted by 0 off the digit positions (K is 10 or 11: small)."""

    shape: torch.Size  # labels' shape
    valid: torch.Tensor  # [N] bool
    safe_labels: torch.Tensor  # [N] long, 0 where not valid (always a legal index)
    numeric: torch.Tensor  # [R] bool, the digit positions (and counted decimal points)
    classes: torch.Tensor  # [R] long, their target class, 0 elsewhere (a legal index)
    weights: torch.Tensor  # [R] place weights u there (ones when place weighting is off), else 0
    # Single-digit vocabularies: R = N, row r is token r.
    # Grouped digits (losses/groups.py): R = N * m, row r is digit slot r % m of token r // m
    # (masked past the token's digits); `slots` the sets each slot's ten class logits are
    # made of. Neither selects rows, so neither waits for the device.
    slots: SlotSets | None = None

    @property
    def slots_per_token(self) -> int:
        """m: rows of the digit terms per token (1 for single digits)."""
        return 1 if self.slots is None else self.slots.offset.shape[1]
