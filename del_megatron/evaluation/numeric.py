"""Teacher-forced numeric metrics from full-vocabulary logits: plain tensor math, summed in
float64 so that batches (and ranks) add up exactly.

At each position whose target is a digit, the digit-conditional distribution p̂ is the
softmax over the ten digit classes (a class's member ids merged by log-sum-exp, as in the
losses), and the greedy digit is its argmax. Numbers are the runs that `losses.places`
finds (digits, with a decimal point inside); every number is read twice, from the target
digits and from the greedy ones at the same places, giving its exact match and its absolute
and relative error. A number cut by the window's edge counts as the part inside.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..losses.config import NumericLossConfig
from ..losses.groups import SlotSets, grouped_places, slot_class_logits, slot_offset
from ..losses.places import digit_places, number_runs
from ..losses.reference import numeric_loss
from ..losses.vocab import NOT_A_CLASS, POINT_CLASS, DigitVocab

ENTROPY_BINS = 20  # histogram of H(p̂) over [0, ln 10]
CALIBRATION_BINS = 10  # of the greedy digit's probability over [0, 1]
MAX_PLACE = 12  # integer places 0..MAX_PLACE-1 and decimal places 1..MAX_PLACE tracked


def _class_logits(logits: torch.Tensor, vocab: DigitVocab) -> torch.Tensor:
    """[n, V] -> [n, 10] digit-class logits (members merged by log-sum-exp); grouped
    vocabularies: [n, U] logits of the number tokens (`DigitVocab.class_members`)."""
    ids, valid = vocab.class_members(10, logits.device)
    member = logits[:, ids]  # [n, 10, M]
    member = member.masked_fill(~valid, float("-inf"))
    return torch.logsumexp(member, dim=-1)


def _number_ids(classes: torch.Tensor, decimal_point: torch.Tensor) -> torch.Tensor:
    """[b, s] long: 1.. for the positions of each number (digits and its point), 0 elsewhere,
    numbered across the batch."""
    member = ((classes >= 0) & (classes <= 9)) | decimal_point
    before = torch.nn.functional.pad(member[:, :-1], (1, 0))
    start = member & ~before
    flat_start = start.flatten()
    ids = torch.cumsum(flat_start.long(), dim=0).view_as(classes)
    return torch.where(member, ids, 0)


class _DigitRows(NamedTuple):
    """One row per digit slot of every position (R = b * s * m; m = 1: one per position),
    every quantity masked by `is_digit` rather than selected."""

    is_digit: torch.Tensor  # [R] bool: a digit of a counted target
    target: torch.Tensor  # [R] long, its digit (0 elsewhere)
    place: torch.Tensor  # [R] long, its power of ten in its number
    number: torch.Tensor  # [R] long, its number's id (0 elsewhere)
    class_logits: torch.Tensor  # [R, 10] its slot's digit-class logits
    token: torch.Tensor  # [R] long, its position's row in [b * s]


def _digit_rows(
    flat: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, vocab: DigitVocab
) -> _DigitRows:
    """flat [N, V] logits, labels and mask [b, s]. Single-digit vocabularies: one row per
    position (a digit target's class); grouped ones (losses/groups.py): m rows per position,
    the slot marginals of its number token's digits, places counted across the number."""
    vocab_size = flat.shape[-1]
    safe = labels.clamp(0, vocab_size - 1)
    table = vocab.class_table(vocab_size, flat.device)
    set_logits = _class_logits(flat, vocab)  # [N, 10] or, grouped, [N, U] number tokens
    rows = torch.arange(labels.numel(), device=flat.device)
    if not vocab.grouped:
        classes = torch.where(mask, table[labels.clamp(0, table.numel() - 1)], NOT_A_CLASS)
        place, decimal_point = digit_places(classes)
        is_digit = ((classes >= 0) & (classes <= 9)).flatten()
        numbers = torch.where(is_digit, _number_ids(classes, decimal_point).flatten(), 0)
        target = classes.flatten().clamp(0, 9)
        return _DigitRows(is_digit, target, place.flatten(), numbers, set_logits, rows)
    m = vocab.max_digits
    count_table, digit_table = vocab.number_table(vocab_size, flat.device)
    count = torch.where(mask, count_table[safe], 0)
    point = mask & (table[safe] == POINT_CLASS)
    classes = torch.where(count > 0, 0, torch.where(point, POINT_CLASS, NOT_A_CLASS))
    place, is_slot = grouped_places(classes, count, m)  # [b, s, m]
    numbers = _number_ids(classes, number_runs(classes).decimal_point)
    slot = torch.arange(m, device=flat.device)
    offset = slot_offset(count.unsqueeze(-1), slot).reshape(-1, m)  # [N, m], in range for all
    token = rows.repeat_interleave(m)
    slots = SlotSets(offset, *vocab.slot_sets(flat.device))
    class_logits = slot_class_logits(set_logits, slots)  # [N * m, 10], row r: token r // m
    is_digit = is_slot.flatten()
    return _DigitRows(
        is_digit,
        torch.where(is_slot, digit_table[safe], 0).flatten(),
        place.flatten(),
        torch.where(is_slot, numbers.unsqueeze(-1), 0).flatten(),
        class_logits,
        token,
    )


def batch_statistics(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    vocab: DigitVocab,
    loss: NumericLossConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Sums of one batch. logits [b, s, V] (V the tokenizer's vocabulary, padding columns
    removed), labels [b, s] (labels[:, t] is the target of logits[:, t]), loss_mask [b, s].
    With a grouped tokenizer every digit statistic is per digit slot (docs/losses.md).
    loss: a loss config with a digit term, whose term's sum and count are added
    ('numeric_sum', 'numeric_count': the training loss' own, `losses.numeric_loss`), for the
    term's share of the loss (`numeric_metrics`' 'numeric_share')."""
    logits = logits.float()
    device = logits.device  # every statistic is made where the logits are
    vocab_size = logits.shape[-1]
    mask = loss_mask.bool()

    # Every quantity is computed at every position and masked (torch.where), never selected
    # by a boolean index: an index by a mask has a data-dependent size, which on a GPU waits
    # for the device each batch.
    flat = logits.view(-1, vocab_size)  # [N, V], N = b * s
    log_z = torch.logsumexp(flat, dim=-1)
    target_logit = flat.gather(1, labels.reshape(-1, 1).clamp(0, vocab_size - 1)).squeeze(1)
    m = mask.flatten()
    nll = torch.where(m, log_z - target_logit, 0.0).double()

    digit_rows = _digit_rows(flat, labels, mask, vocab)
    d = digit_rows.is_digit  # [R]
    weight = d.double()  # 1 at digit targets, 0 elsewhere
    target = digit_rows.target
    class_logp = torch.log_softmax(digit_rows.class_logits, dim=-1).double()  # [R, 10]
    p = class_logp.exp()
    greedy = p.argmax(dim=-1)
    cond_correct = (greedy == target) & d
    token_is_max = target_logit >= flat.max(dim=-1).values  # a top token of the row
    full_correct = token_is_max[digit_rows.token] & d
    entropy = torch.where(d, -(p * class_logp).sum(-1), 0.0)
    # the level of the ten class logits, which softmax ignores and DEL's BCE on raw logits
    # does not (docs/losses.md, "Is DEL learned from or escaped?")
    class_logits = digit_rows.class_logits.double()
    level = torch.where(d, class_logits.mean(-1), 0.0)
    log_sum_exp = torch.where(
        d, torch.logsumexp(torch.where(d.unsqueeze(1), class_logits, 0.0), -1), 0.0
    )
    confidence = torch.where(d, p.max(dim=-1).values, 0.0)

    places = torch.where(d, digit_rows.place, 0)
    decimal = places < 0  # digit_places: decimal digits have negative places
    place_index = torch.where(decimal, MAX_PLACE - 1 - places, places).clamp(0, 2 * MAX_PLACE - 1)
    place_counts = torch.zeros(2 * MAX_PLACE, 2, dtype=torch.float64, device=device)
    place_counts[:, 1].index_add_(0, place_index, weight)
    place_counts[:, 0].index_add_(0, place_index, cond_correct.double())

    entropy_bin = (entropy / math.log(10) * ENTROPY_BINS).long().clamp(0, ENTROPY_BINS - 1)
    entropy_hist = torch.zeros(ENTROPY_BINS, dtype=torch.float64, device=device)
    entropy_hist.index_add_(0, entropy_bin, weight)
    conf_bin = (confidence * CALIBRATION_BINS).long().clamp(0, CALIBRATION_BINS - 1)
    # count, confidence, correct
    calibration = torch.zeros(CALIBRATION_BINS, 3, dtype=torch.float64, device=device)
    calibration[:, 0].index_add_(0, conf_bin, weight)
    calibration[:, 1].index_add_(0, conf_bin, confidence)
    calibration[:, 2].index_add_(0, conf_bin, cond_correct.double())

    # numbers: value = sum of digit * 10^place, read from targets and from greedy digits.
    # Number ids stay below b * s + 1 (one per position at most): a bound known without
    # reading the largest id to the host. Id 0 collects the positions outside numbers, with
    # weight 0 from every one of them.
    numbers = digit_rows.number
    count = labels.numel() + 1
    scale = torch.pow(10.0, places.double())
    per_number = torch.zeros(4, count, dtype=torch.float64, device=device)
    true_value, greedy_value, wrong, digits_in = per_number
    true_value.index_add_(0, numbers, torch.where(d, target * scale, 0.0))
    greedy_value.index_add_(0, numbers, torch.where(d, greedy * scale, 0.0))
    wrong.index_add_(0, numbers, (d & ~cond_correct).double())
    digits_in.index_add_(0, numbers, weight)
    has_digits = digits_in > 0
    abs_error = torch.where(has_digits, (greedy_value - true_value).abs(), 0.0)
    nonzero = has_digits & (true_value != 0)
    rel_error = torch.where(nonzero, abs_error / true_value.abs(), 0.0)
    term = {}
    if loss is not None:
        out = numeric_loss(logits, labels, vocab, loss, loss_mask)  # the training loss' term
        term = {k: out.stats[k] for k in ("numeric_sum", "numeric_count")}
    return {
        **term,
        "digit_logit": level.sum(),
        "digit_logsumexp": log_sum_exp.sum(),
        "tokens": m.sum().double(),
        "nll": nll.sum(),
        "digits": weight.sum(),
        "digit_correct": full_correct.double().sum(),
        "digit_cond_correct": cond_correct.double().sum(),
        "entropy": entropy.sum(),
        "numbers": has_digits.sum().double(),
        "numbers_exact": (has_digits & (wrong == 0)).double().sum(),
        "abs_error": abs_error.sum(),
        "rel_numbers": nonzero.sum().double(),
        "rel_error": rel_error.sum(),
        "places": place_counts,
        "entropy_hist": entropy_hist,
        "calibration": calibration,
    }


def numeric_metrics(sums: dict, alpha: float | None = None) -> dict:
    """The metrics from `batch_statistics` summed over batches (and ranks) and read to the
    host (`pipeline.reduce_and_read`: floats and nested lists). alpha: the coefficient of
    the loss whose digit term `batch_statistics` summed (its `loss`), for 'numeric' (the
    term: sum / count over every batch) and 'numeric_share' (alpha·numeric / (CE +
    alpha·numeric), the term's share of that loss)."""
    t = sums
    tokens, digits = t["tokens"], t["digits"]
    loss = t["nll"] / tokens if tokens else float("nan")
    by_place = {}
    for index, (correct, count) in enumerate(t["places"]):
        if count:
            name = f"int_{index}" if index < MAX_PLACE else f"dec_{index - MAX_PLACE + 1}"
            by_place[name] = correct / count
    calibration_error = 0.0
    for count, confidence, correct in t["calibration"]:
        if count:
            calibration_error += count / digits * abs(correct / count - confidence / count)
    div = lambda a, b: a / b if b else float("nan")  # noqa: E731
    return {
        "tokens": int(tokens),
        "loss": loss,
        "perplexity": math.exp(loss) if loss == loss else float("nan"),
        "digits": int(digits),
        "digit_acc": div(t["digit_correct"], digits),
        "digit_cond_acc": div(t["digit_cond_correct"], digits),
        "digit_acc_by_place": by_place,
        "numbers": int(t["numbers"]),
        "number_exact_match": div(t["numbers_exact"], t["numbers"]),
        "number_abs_error": div(t["abs_error"], t["numbers"]),
        "number_rel_error": div(t["rel_error"], t["rel_numbers"]),
        "digit_entropy": div(t["entropy"], digits),
        "digit_logit": div(t["digit_logit"], digits),
        "digit_logsumexp": div(t["digit_logsumexp"], digits),
        "digit_entropy_histogram": {
            "edges": [i * math.log(10) / ENTROPY_BINS for i in range(ENTROPY_BINS + 1)],
            "counts": [int(c) for c in t["entropy_hist"]],
        },
        "digit_calibration_error": calibration_error if digits else float("nan"),
        **_term_share(t, loss, alpha),
    }


def _term_share(sums: dict, ce: float, alpha: float | None) -> dict:
    """{'numeric', 'numeric_share'} where a digit term was summed and its alpha is given."""
    if "numeric_sum" not in sums or alpha is None:
        return {}
    count = sums["numeric_count"]
    numeric = sums["numeric_sum"] / count if count else 0.0  # no digit: 0, as in the losses
    objective = ce + alpha * numeric
    return {"numeric": numeric, "numeric_share": alpha * numeric / objective}
