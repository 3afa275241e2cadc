"""Grouped digits: number tokens of 1..m digits (Llama-3's `\\p{N}{1,3}`), docs/losses.md.

G_k is the set of number tokens of exactly k digits. At a position whose target is a k-digit
number token d_0 .. d_{k-1}, digit slot j has the class logits
z_d = logsumexp{ z_c : c in G_k, c[j] = d } (d = 0..9): the model's marginal of digit j
among k-digit number tokens. The ops (reference, vocabulary-parallel, fused) see each number
token as a class of its own (`DigitVocab.class_members`) and hand over its exact raw logit,
[N, U]; this module turns the targets into m rows per token, one per digit slot (the slot's
digit, the place weight of that digit in the whole number; a mask and weight 0 past the
token's digits and off number tokens), and forms each slot's ten set log-sum-exps from its
token's U logits (`slot_class_logits`, the (k, j, d) sets of `DigitVocab.slot_sets`,
S = 10 * (1 + 2 + .. + m) of them); `assemble` then runs every digit term on [N * m, 10] as
it runs them on [N, 10] for single digits. Fixed shapes, no selection of the slots: a
selection's size depends on the labels, which a GPU tells the host only by waiting for it,
once per micro-batch. The price: every token's m slots gather their sets' padded members,
[N, m, 10, W] (W, the largest set, is 10^(m-1) for a full vocabulary: 3,000 values a
token for m = 3, against V/tp logits a token).
A single-digit vocabulary forced through here gives the single-digit numbers bit for bit
(tests/losses/test_groups.py).
"""

from __future__ import annotations

import torch

from .config import NumericLossConfig
from .places import number_runs, place_weights
from .targets import SlotSets, Targets
from .vocab import NOT_A_CLASS, POINT_CLASS, DigitVocab


def slot_offset(count: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Column of digit 0 of slot j of k-digit tokens among the S set columns:
    10 * (1 + 2 + .. + (k - 1) + j), the order of `DigitVocab.group_sets`."""
    return 10 * (count * (count - 1) // 2 + slot)


def grouped_places(
    classes: torch.Tensor,
    count: torch.Tensor,
    max_digits: int,
    document_starts: torch.Tensor | None = None,
):
    """Place of every digit of every number token.

    classes: [..., s] long, 0 at number tokens (any digit), POINT_CLASS at '.', negative
    elsewhere; count: [..., s] long, digits of each number token (0 elsewhere);
    document_starts: [..., s] bool or None, where packed documents start (`number_runs`).
    Returns place [..., s, m] long (power of ten of digit j of the token at t in its whole
    number: "12345" as "123", "45" gives 4, 3, 2 and 1, 0) and is_slot [..., s, m] bool
    (j < count). A run's digits are counted with cumulative sums of `count` instead of
    positions, so with m = 1 this is `digit_places`.
    """
    runs = number_runs(classes, document_starts)
    digits_through = torch.cumsum(count, dim=-1)  # digits at or before t
    digits_before = digits_through - count
    run_end = (runs.next_non_digit - 1).clamp_min(0)  # a number token's run's last token
    after = digits_through.gather(-1, run_end) - digits_through  # digits after t in its run
    opened = runs.last_non_digit  # the '.' before a decimal run (always >= 0 there)
    before_run = torch.where(
        opened >= 0, digits_through.gather(-1, opened.clamp_min(0)), torch.zeros_like(count)
    )
    before = digits_before - before_run  # digits before t in its (decimal) run
    slot = torch.arange(max_digits, device=classes.device)
    integer = (after + count - 1).unsqueeze(-1) - slot
    decimal = -(before + 1).unsqueeze(-1) - slot
    place = torch.where(runs.decimal_run.unsqueeze(-1), decimal, integer)
    is_slot = runs.is_digit.unsqueeze(-1) & (slot < count.unsqueeze(-1))
    return torch.where(is_slot, place, 0), is_slot


def grouped_targets(
    valid: torch.Tensor,
    safe: torch.Tensor,
    vocab: DigitVocab,
    cfg: NumericLossConfig,
    vocab_size: int,
    dtype: torch.dtype,
    document_starts: torch.Tensor | None = None,
) -> Targets:
    """`Targets` with m rows per token, row r slot r % m of token r // m: valid, safe,
    document_starts [..., s] (as `prepare_targets` has them). numeric [N * m]: whether the
    slot is a digit of a number token (j < its digit count); classes [N * m] the slot's
    digit, weights [N * m] u(place), both 0 elsewhere; slots: each slot's sets
    (`SlotSets`)."""
    if cfg.include_decimal_point:
        vocab.class_members(11, safe.device)  # refuses it, in one line
    count_table, digit_table = vocab.number_table(vocab_size, safe.device)
    count = torch.where(valid, count_table[safe], 0)
    point = valid & (vocab.class_table(vocab_size, safe.device)[safe] == POINT_CLASS)
    classes = torch.where(count > 0, 0, torch.where(point, POINT_CLASS, NOT_A_CLASS))
    place, is_slot = grouped_places(classes, count, vocab.max_digits, document_starts)
    if cfg.resolved_place_weighting:
        weights = place_weights(place, cfg.place_slope, cfg.decimal_base, dtype)
    else:
        weights = torch.ones(place.shape, dtype=dtype, device=safe.device)
    slot = torch.arange(vocab.max_digits, device=safe.device)
    # a legal set off the slots (offset 0: the single digits' sets): gathered, never read,
    # given no gradient
    offset = torch.where(is_slot, slot_offset(count.unsqueeze(-1), slot), 0)
    return Targets(
        shape=valid.shape,
        valid=valid.flatten(),
        safe_labels=safe.flatten(),
        numeric=is_slot.flatten(),
        classes=torch.where(is_slot, digit_table[safe], 0).flatten(),
        weights=torch.where(is_slot, weights, 0).flatten().to(dtype),
        slots=SlotSets(offset.flatten(0, -2), *vocab.slot_sets(safe.device)),
    )


class _SetLogSumExp(torch.autograd.Function):
    """members [R, 10, W] (padding masked by valid) -> their log-sum-exp [R, 10]; the gradient
    spread by each member's share, as the ops spread a digit class's (so a single-digit
    vocabulary forced through here gives their numbers bit for bit)."""

    @staticmethod
    def forward(ctx, members, valid):
        members = members.masked_fill(~valid, float("-inf"))
        ctx.save_for_backward(torch.softmax(members, dim=-1))
        return torch.logsumexp(members, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        (share,) = ctx.saved_tensors
        return grad.unsqueeze(-1) * share, None


def slot_class_logits(class_logits: torch.Tensor, slots: SlotSets | None) -> torch.Tensor:
    """The ten class logits of each digit slot [N * m, 10] (rows as `grouped_targets`'), from
    the raw logits of the number tokens at each token [N, U] (the ops' class logits for a
    grouped vocabulary): the log-sum-exp of each (k, j, d) set. None (single-digit
    vocabularies): as given."""
    if slots is None:
        return class_logits
    sets = slots.offset.unsqueeze(-1) + torch.arange(10, device=slots.offset.device)
    members, valid = slots.members[sets], slots.valid[sets]  # [N, m, 10, W]
    # flatten, not view(N, -1): a micro-batch of no token has N = 0
    gathered = class_logits.gather(1, members.flatten(1)).view(members.shape)
    return _SetLogSumExp.apply(gathered.flatten(0, 1), valid.flatten(0, 1))


def target_is_max_of_rows(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Whether each row's target logit is the row maximum, logits [N, V], targets [N]: a max
    over every row, read in place. Copying the digit rows out first, as for single digits,
    copies each number token's row once per digit (a [n, V] copy: most of the loss' time at
    V = 128256 on CPU, docs/benchmarks.md); `assemble` picks the digit slots' rows."""
    target_logit = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    return target_logit >= logits.amax(-1)
