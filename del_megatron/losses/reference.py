"""The single-device reference: `numeric_loss` on full-vocabulary logits, plain PyTorch.

CE and the digit-class logits come from one autograd function that saves a single
float32 log-softmax buffer (as F.cross_entropy does) and builds the dense gradient in one
pass; the digit terms on the [N, K] class logits (weighted 0 off the digit positions) are
ordinary autograd.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .assemble import (
    NumericLossOutput,
    assemble,
    check_logits_labels,
    compute_dtype,
    prepare_targets,
)
from .config import NumericLossConfig
from .groups import target_is_max_of_rows
from .saved import load, save
from .vocab import DigitVocab
from .vocab_parallel import class_log_sum_exp


class _CrossEntropySaved(NamedTuple):
    """What `_CrossEntropyAndClassLogits` keeps for backward."""

    log_probs: torch.Tensor  # [N, V] compute dtype, the one [N, V] buffer
    target: torch.Tensor  # [N] long
    member_ids: torch.Tensor  # [K, M] long, each class's member ids
    member_share: torch.Tensor  # [N, K, M] d class_logit / d member logit


class _CrossEntropyAndClassLogits(torch.autograd.Function):
    """logits [N, V] -> ce [N], class_logits [N, K] (log-sum-exp over each class's ids)."""

    @staticmethod
    def forward(ctx, logits, target, member_ids, member_valid, vocab_size):
        dtype = compute_dtype(logits.dtype)
        z = logits[:, :vocab_size]  # padded columns never get probability mass
        log_probs = torch.log_softmax(z, dim=-1, dtype=dtype)  # [N, V], the saved buffer
        ce = -log_probs.gather(1, target.unsqueeze(1)).squeeze(1)
        num_classes, width = member_ids.shape
        members = z.index_select(1, member_ids.flatten()).to(dtype)
        # [N, K] class logits, and d class_logit / d member logit
        class_logits, member_share = class_log_sum_exp(
            members.view(-1, num_classes, width), member_valid
        )
        saved = _CrossEntropySaved(
            log_probs=log_probs, target=target, member_ids=member_ids, member_share=member_share
        )
        save(ctx, saved)
        ctx.logits_meta = (logits.shape, logits.dtype)
        return ce, class_logits

    @staticmethod
    def backward(ctx, grad_ce, grad_class):
        saved = load(ctx, _CrossEntropySaved)
        shape, dtype = ctx.logits_meta
        grad = torch.exp(saved.log_probs).mul_(grad_ce.unsqueeze(1))  # softmax * dCE
        grad.scatter_add_(1, saved.target.unsqueeze(1), -grad_ce.unsqueeze(1))
        member_grad = (grad_class.unsqueeze(-1) * saved.member_share).flatten(1)
        grad.index_add_(1, saved.member_ids.flatten(), member_grad)
        if grad.shape[1] != shape[1]:
            grad = torch.nn.functional.pad(grad, (0, shape[1] - grad.shape[1]))
        return grad.to(dtype), None, None, None, None


def numeric_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: DigitVocab,
    cfg: NumericLossConfig | None = None,
    loss_mask: torch.Tensor | None = None,
    *,
    cost_embedding: torch.Tensor | None = None,
    document_starts: torch.Tensor | None = None,
) -> NumericLossOutput:
    """CE + alpha * numeric part of cfg.kind, on one device.

    logits: [..., s, V] (any float dtype; half is computed in float32, the input is never
    modified); labels: [..., s], already shifted (labels[..., t] is the target of
    logits[..., t, :]), cfg.ignore_index where there is none; loss_mask: [..., s], nonzero =
    counted. cost_embedding: [V, h] rows L2-normalized (see `emo_cost_embedding`), emo only.
    document_starts: [..., s] bool, True at the first label position of each packed document
    (`documents.document_starts_of`): numbers end there; None: one document per row.
    """
    cfg = cfg or NumericLossConfig()
    check_logits_labels(logits.shape, labels, "logits")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    vocab_size = _true_vocab_size(vocab, logits.shape[-1])
    dtype = compute_dtype(logits.dtype)
    targets = prepare_targets(labels, vocab, cfg, loss_mask, vocab_size, dtype, document_starts)

    flat = logits.reshape(-1, logits.shape[-1])
    member_ids, member_valid = vocab.class_members(cfg.num_classes, logits.device)
    ce, class_logits = _CrossEntropyAndClassLogits.apply(
        flat, targets.safe_labels, member_ids, member_valid, vocab_size
    )
    with torch.no_grad():
        if targets.slots is not None:  # grouped digits: every row's test, read in place
            target_is_max = target_is_max_of_rows(flat[:, :vocab_size], targets.safe_labels)
        else:
            # the argmax test reads [n, V] rows of the digit positions only; selecting them waits
            # for the device once (`nonzero`), which this single-device reference accepts (the
            # training path, the vocabulary-parallel ops, finds the row maxima in its all-reduce)
            rows = targets.numeric.nonzero().squeeze(1)
            digit_rows = flat.index_select(0, rows)[:, :vocab_size]
            target_logit = digit_rows.gather(1, targets.safe_labels[rows].unsqueeze(1)).squeeze(1)
            target_is_max = torch.zeros_like(targets.numeric)
            target_is_max[rows] = target_logit >= digit_rows.amax(-1)

    emo_cost = None
    if cfg.kind_spec.needs_cost_embedding:
        emo_cost = _emo_cost(flat[:, :vocab_size], targets.safe_labels, cost_embedding, dtype)
    return assemble(targets, ce, class_logits, target_is_max, cfg, emo_cost)


def _true_vocab_size(vocab: DigitVocab, num_columns: int) -> int:
    if vocab.vocab_size is None:
        return num_columns
    if vocab.vocab_size > num_columns:
        raise ValueError(
            f"logits have {num_columns} vocabulary columns but the tokenizer has "
            f"{vocab.vocab_size} tokens"
        )
    return vocab.vocab_size


def emo_cost_embedding(output_weight: torch.Tensor) -> torch.Tensor:
    """EMO's frozen cost embedding: the output layer's weights [V, h], rows L2-normalized."""
    return torch.nn.functional.normalize(output_weight.detach().float(), dim=-1)


def _emo_cost(
    logits: torch.Tensor,
    target: torch.Tensor,
    cost_embedding: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """EMO transport cost [N]: 1 - e_y . sum_v q_v e_v with q = softmax(logits)."""
    if cost_embedding is None:
        raise ValueError("kind='emo' needs cost_embedding=emo_cost_embedding(output_layer.weight)")
    vocab_size = logits.shape[-1]
    if cost_embedding.dim() != 2 or cost_embedding.shape[0] < vocab_size:
        raise ValueError(
            f"cost_embedding must be [vocab >= {vocab_size}, hidden], "
            f"got {tuple(cost_embedding.shape)}"
        )
    embedding = cost_embedding[:vocab_size].to(dtype)
    expected = torch.softmax(logits.to(dtype), dim=-1) @ embedding  # [N, h]
    return 1 - (embedding.index_select(0, target) * expected).sum(-1)
