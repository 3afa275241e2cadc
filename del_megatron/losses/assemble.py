"""From per-token CE and digit-class logits to the loss, per-token losses and statistics.

Shared by the single-device reference (`reference.py`) and the tensor-parallel op
(`vocab_parallel.py`): both compute the same three inputs (ce_t, class logits, whether the
target is the argmax) their own way, then call `assemble`, so they cannot drift apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import NumericLossConfig
from .groups import grouped_targets, slot_class_logits
from .kinds import Objective, numeric_term
from .places import digit_places, place_weights
from .targets import Targets
from .terms import digit_entropy
from .vocab import NOT_A_CLASS, POINT_CLASS, DigitVocab


class NumericStats(dict):
    """The statistics of a `NumericLossOutput` (STAT_KEYS -> 0-dim float64 tensors): a dict
    that refuses to be read as a tensor. A loss function that takes a model's output tuple
    as (per-token losses, loss mask) (Megatron-Bridge's `masked_next_token_loss` does, with
    `output[1].view(-1)`) reaches this dict and raises, instead of multiplying the per-token
    losses by a scalar and returning a wrong loss without a word."""

    def view(self, *shape):
        raise TypeError(
            "this is the numeric loss head's output (per-token losses, statistics, ...), read "
            "as (losses, loss_mask) by another loss function: use del_megatron's loss_func "
            "(Megatron-LM: del_megatron.models.megatron_lm; Megatron-Bridge: "
            "del_megatron.models.megatron_bridge.forward_step)"
        )


class NumericLossOutput(NamedTuple):
    """per_token: labels' shape; per_token.sum() / stats['tokens'] == loss.
    stats: 0-dim float64 sums and counts (see STAT_KEYS), exact to reduce across ranks.
    loss, ce, numeric: scalars with loss = ce + alpha * numeric for the digit kinds (for
    mixce and emo, loss is their objective, ce the plain CE, numeric 0 / the EMO cost).

    A named tuple, not a dataclass: a model's forward returns it, and wrappers that hook the
    tensors a module returns (DeepSpeed ZeRO 3 re-gathers parameters for backward through
    them) walk tuples and dicts, not dataclasses; megatron's Float16Module makes it a plain
    tuple (`NumericLossOutput(*output)` rebuilds it). The per-token losses come first, as
    megatron-core's GPTModel returns them, and the statistics second, so that a loss function
    reading a tuple as (losses, loss_mask) fails (`NumericStats.view`)."""

    per_token: torch.Tensor
    stats: NumericStats
    loss: torch.Tensor
    ce: torch.Tensor
    numeric: torch.Tensor

    def view(self, *shape):
        # megatron's own pretrain_gpt.loss_func reads the model's output as a tensor
        # (`output_tensor.view(-1)`): reached when the builder is used without the forward
        # step's wrapper; said here, which line is missing (issue 51)
        raise AttributeError(
            "'NumericLossOutput' is the numeric loss head's output, read as a tensor by "
            "megatron's own loss function: pass forward_step_func="
            "megatron_lm.forward_step(pretrain_gpt.forward_step) (Megatron-LM) or "
            "del_megatron.models.megatron_bridge.forward_step (Megatron-Bridge)"
        )


STAT_KEYS = (
    "tokens",  # unmasked positions
    "ce_sum",  # sum of CE over them
    "digits",  # digit positions (targets in the classes)
    "numeric_sum",  # sum of u*l over digit positions (EMO: of the transport cost over tokens)
    "numeric_count",  # what numeric_sum is divided by under cfg.normalize
    "digit_correct",  # digit positions whose target is the argmax over the full vocabulary
    "digit_cond_correct",  # ... whose target is the argmax of the digit distribution
    "digit_entropy_sum",  # sum of -sum_k p_k log p_k
    "value_digits",  # digit positions whose target is a digit 0..9 (not '.')
    "digit_abs_error_sum",  # sum of |argmax-digit - target digit| over value_digits
    # the level of the digit-class logits at digit positions, which softmax ignores and the
    # DEL term's BCE on raw logits does not (docs/losses.md, "the logit-shift escape")
    "digit_logit_sum",  # sum of the mean class logit (1/K) sum_k z_k
    "digit_logsumexp_sum",  # sum of log sum_k exp(z_k)
)

# Metric name -> (sum key, count key): the report pairs of docs/losses.md.
REPORT_PAIRS = {
    "ce": ("ce_sum", "tokens"),
    "numeric": ("numeric_sum", "numeric_count"),
    "digit_acc": ("digit_correct", "digits"),
    "digit_cond_acc": ("digit_cond_correct", "digits"),
    "digit_entropy": ("digit_entropy_sum", "digits"),
    "digit_abs_error": ("digit_abs_error_sum", "value_digits"),
    "digit_logit": ("digit_logit_sum", "digits"),
    "digit_logsumexp": ("digit_logsumexp_sum", "digits"),
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision logits are computed in float32; float32/float64 stay as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_logits_labels(logits_shape: torch.Size, labels: torch.Tensor, what: str) -> None:
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.dim() < 1 or tuple(logits_shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"{what} {tuple(logits_shape)} do not match labels {tuple(labels.shape)}: "
            "expected logits [..., vocab] with labels [...]"
        )


def prepare_targets(
    labels: torch.Tensor,
    vocab: DigitVocab,
    cfg: NumericLossConfig,
    loss_mask: torch.Tensor | None,
    vocab_size: int,
    dtype: torch.dtype,
    document_starts: torch.Tensor | None = None,
) -> Targets:
    """Validate labels (the last dim is the sequence) and find digit positions and weights.

    document_starts: labels' shape, bool, True at the first label position of each document
    of a packed row (`documents.document_starts_of`): numbers end there. None: every row is
    one document (numbers end only at row edges and non-digits)."""
    valid = labels != cfg.ignore_index
    if loss_mask is not None:
        if loss_mask.shape != labels.shape:
            raise ValueError(
                f"loss_mask {tuple(loss_mask.shape)} does not match labels {tuple(labels.shape)}"
            )
        valid = valid & (loss_mask != 0)
    if document_starts is not None:
        if document_starts.shape != labels.shape or document_starts.dtype != torch.bool:
            raise ValueError(
                f"document_starts must be a bool tensor of the labels' shape "
                f"{tuple(labels.shape)}, got {document_starts.dtype} "
                f"{tuple(document_starts.shape)}"
            )
    bad = valid & ((labels < 0) | (labels >= vocab_size))
    message = (
        f"a label is out of range for a vocabulary of {vocab_size} tokens "
        f"(use ignore_index={cfg.ignore_index} for positions without a target)"
    )
    try:
        # checked on the device: a host read here would stall every GPU micro-batch (on
        # CUDA a failure is a device-side assert at the next synchronisation)
        torch._assert_async(~bad.any(), message)
    except RuntimeError:  # raised at once on CPU
        raise ValueError(message) from None
    safe = torch.where(valid, labels, 0).long()
    if vocab.grouped:
        return grouped_targets(valid, safe, vocab, cfg, vocab_size, dtype, document_starts)
    table = vocab.class_table(vocab_size, labels.device)
    classes = torch.where(valid, table[safe], NOT_A_CLASS)  # [..., s]
    place, decimal_point = digit_places(classes, document_starts)
    is_digit = (classes >= 0) & (classes <= 9)
    numeric = is_digit | (
        decimal_point if cfg.include_decimal_point else torch.zeros_like(is_digit)
    )
    if cfg.resolved_place_weighting:
        # A decimal point that is a class weighs 1 (spec: "the '.' itself weighs 0, 1 if a class").
        weights = torch.where(
            is_digit, place_weights(place, cfg.place_slope, cfg.decimal_base, dtype), 1.0
        )
    else:
        weights = torch.ones(classes.shape, dtype=dtype, device=labels.device)
    return Targets(
        shape=labels.shape,
        valid=valid.flatten(),
        safe_labels=safe.flatten(),
        numeric=numeric.flatten(),
        classes=torch.where(numeric, classes, 0).flatten(),
        weights=torch.where(numeric, weights.to(dtype), 0).flatten(),
    )


def assemble(
    targets: Targets,
    ce_per_token: torch.Tensor,
    class_logits: torch.Tensor,
    target_is_max: torch.Tensor,
    cfg: NumericLossConfig,
    emo_cost: torch.Tensor | None = None,
) -> NumericLossOutput:
    """Combine the parts into the loss of cfg.kind.

    ce_per_token: [N] CE of every row (any value where not valid); class_logits: [N, K] of
    every row (any value off the digit positions: never read there, and given no gradient;
    grouped digits: [N, U] raw logits of the number tokens, made [N * m, 10] here);
    target_is_max: [N] bool;
    emo_cost: [N] EMO transport cost (emo only).
    """
    dtype = ce_per_token.dtype
    m = targets.slots_per_token
    target_is_max = target_is_max.unsqueeze(1).expand(-1, m).flatten()  # each slot its token's
    class_logits = slot_class_logits(class_logits, targets.slots)
    valid = targets.valid.to(dtype)
    num_tokens = valid.sum()
    token_denominator = num_tokens.clamp_min(1)
    ce_sum = (ce_per_token * valid).sum()
    ce = ce_sum / token_denominator

    # ---- the token-level objective (CE, or MixCE / EMO reweighting of it)
    kind = cfg.kind_spec
    if kind.objective is Objective.MIXCE:
        keep = torch.exp(-ce_per_token).detach()
        per_token = (cfg.mixce_eta + (1 - cfg.mixce_eta) * keep) * ce_per_token * valid
    elif kind.objective is Objective.EMO:
        if emo_cost is None:
            raise ValueError("kind='emo' needs the EMO transport cost (pass cost_embedding)")
        emo_sum = (emo_cost * valid).sum()
        # EMO's dynamic weight sg(CE / emo), as a ratio of micro-batch sums.
        ratio = (ce_sum / emo_sum.clamp_min(torch.finfo(dtype).tiny)).detach()
        per_token = 0.5 * (ce_per_token + ratio * emo_cost) * valid
    else:
        per_token = ce_per_token * valid
    base_loss = per_token.sum() / token_denominator

    # ---- the digit-level part
    num_digits = targets.numeric.sum().to(dtype)
    numeric_sum = torch.zeros((), dtype=dtype, device=valid.device)
    alpha = cfg.resolved_alpha
    digit_rows = targets.numeric.unsqueeze(1)
    if kind.digit_term is not None:
        # off the digit positions the term reads zeros (finite, whatever the logits there) and
        # its weight is 0; the where() gives those rows no gradient
        term = numeric_term(torch.where(digit_rows, class_logits, 0.0), targets.classes, cfg)
        weighted = targets.weights * term  # [N], 0 off the digit positions
        numeric_sum = weighted.sum()
        numeric_count = num_digits if cfg.normalize == "digits" else num_tokens
        numeric = numeric_sum / numeric_count.clamp_min(1)
        # per_token carries alpha*u*l scaled so that per_token.sum() / tokens == loss.
        scale = alpha * token_denominator / numeric_count.clamp_min(1)
        # a token's digit slots add up on its row, one slot after the other (m is 1 to 3)
        for slot in (scale * weighted).view(-1, m).unbind(1):
            per_token = per_token + slot
        loss = base_loss + alpha * numeric
    elif kind.objective is Objective.EMO:
        numeric_sum = (emo_cost * valid).sum()
        numeric_count = num_tokens
        numeric = numeric_sum / token_denominator
        loss = base_loss
    else:
        numeric_count = torch.zeros_like(num_tokens)
        numeric = numeric_sum
        loss = base_loss

    stats = _digit_stats(targets, class_logits.detach(), target_is_max)
    stats.update(
        tokens=num_tokens,
        ce_sum=ce_sum,
        numeric_sum=numeric_sum,
        numeric_count=numeric_count,
        digits=num_digits,
    )
    stats = NumericStats({k: stats[k].detach().to(torch.float64) for k in STAT_KEYS})
    return NumericLossOutput(
        loss=loss,
        ce=ce,
        numeric=numeric,
        per_token=per_token.view(targets.shape),
        stats=stats,
    )


def _digit_stats(
    targets: Targets, class_logits: torch.Tensor, target_is_max: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The digit statistics, every row read, only the digit positions counted."""
    classes, numeric = targets.classes, targets.numeric
    class_logits = torch.where(numeric.unsqueeze(1), class_logits, 0.0)
    is_value = numeric & (classes < POINT_CLASS)
    predicted_digit = class_logits[:, :10].argmax(-1)
    abs_error = (predicted_digit - classes).abs().to(class_logits.dtype)
    entropy = torch.where(numeric, digit_entropy(class_logits), 0.0)
    level = torch.where(numeric, class_logits.mean(-1), 0.0)
    log_sum_exp = torch.where(numeric, torch.logsumexp(class_logits, -1), 0.0)
    return {
        "digit_logit_sum": level.sum(),
        "digit_logsumexp_sum": log_sum_exp.sum(),
        "digit_correct": (target_is_max & numeric).sum(),
        "digit_cond_correct": ((class_logits.argmax(-1) == classes) & numeric).sum(),
        "digit_entropy_sum": entropy.sum(),
        "value_digits": is_value.sum(),
        "digit_abs_error_sum": (abs_error * is_value).sum(),
    }


def report_pairs(stats: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Metric name -> (sum, count), e.g. for Megatron's loss_func report dict."""
    return {name: (stats[s], stats[c]) for name, (s, c) in REPORT_PAIRS.items()}
