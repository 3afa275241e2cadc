"""The numeric losses on tensor-parallel vocabulary shards (megatron layout [s, b, V/tp]).

Forward: one all-reduce MAX (row maxima) and one all-reduce SUM of a packed [tokens, 2 + K*M]
buffer (sum of exponentials, target logit, the raw logits of the K*M digit-class member ids,
each contributed by the rank that owns it and 0 elsewhere). Every rank then holds the exact
class logits and computes the same digit terms (`assemble`, shared with the reference).
Backward: no collective; each rank writes the gradient of the columns it owns into the
float32 exp buffer saved in forward (the only [tokens, V/tp] buffer kept, as megatron's CE).
EMO adds one all-reduce of [tokens, 2 * hidden] (expected embedding and target embedding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import collectives
from .assemble import (
    NumericLossOutput,
    assemble,
    check_logits_labels,
    compute_dtype,
    prepare_targets,
)
from .config import NumericLossConfig
from .saved import load, save
from .targets import Targets
from .vocab import DigitVocab


def local_ids(target, member_ids, member_valid, vocab_start, owned):
    """Which of the targets [N] and digit-class member ids [K, M] fall in this rank's owned
    columns, and their column there (0 where not owned): owns_target [N], local_target [N],
    owns_member [K*M], local_member [K*M]."""
    flat_ids = member_ids.flatten()
    owns_target = (target >= vocab_start) & (target < vocab_start + owned)
    local_target = torch.where(owns_target, target - vocab_start, 0)
    owns_member = (
        (flat_ids >= vocab_start) & (flat_ids < vocab_start + owned) & member_valid.flatten()
    )
    local_member = torch.where(owns_member, flat_ids - vocab_start, 0)
    return owns_target, local_target, owns_member, local_member


def parts_from_sums(sum_exp, target_logit, member_logits, row_max, member_valid):
    """Per-token sums (over every rank) -> ce [N], class logits [N, K], member shares
    [N, K, M] (each member's part of its class), target_is_max [N]."""
    rows = sum_exp.shape[0]
    members = member_logits.reshape(rows, *member_valid.shape)
    class_logits, member_share = class_log_sum_exp(members, member_valid)
    ce = torch.log(sum_exp) + row_max - target_logit
    return ce, class_logits, member_share, target_logit >= row_max


def class_log_sum_exp(members, member_valid):
    """members [N, K, M] -> class logits [N, K] (log-sum-exp of the valid members) and each
    member's share [N, K, M]. One member per class (a grouped vocabulary's number tokens,
    1110 of them for Llama-3): the member itself and a share of 1, the same numbers without
    a softmax and a log-sum-exp over a dimension of one per element."""
    if member_valid.shape[-1] == 1:  # every class has a member: nothing is padding
        return members.squeeze(-1), torch.ones_like(members)
    members = members.masked_fill(~member_valid, float("-inf"))
    return torch.logsumexp(members, dim=-1), torch.softmax(members, dim=-1)


def logit_gradient_(
    exp, sum_exp, grad_ce, local_target, owns_target, member_grad, local_member, emo_parts=None
):
    """exp [c, owned] = exp(z - max) of some rows becomes, in place, the gradient of the loss
    with respect to their logits z: softmax * dCE (+ the EMO part), minus dCE at the target,
    plus each digit class's gradient spread over its member ids by their shares.
    emo_parts: (cost [owned, h], target embedding [c, h], emo [c], grad_emo [c]) or None.
    A shard of padding only (owned == 0) has no gradient to write: its local ids are all 0,
    which would index past its empty columns."""
    if exp.shape[1] == 0:
        return exp
    if emo_parts is not None:
        cost, target_embedding, emo, grad_emo = emo_parts
        # d emo_t / d z_u = -q_u (e_t . e_u - (1 - emo_t))
        similarity = target_embedding @ cost.T  # [c, owned]
        similarity.sub_((1 - emo).unsqueeze(1)).mul_(-grad_emo.unsqueeze(1))
        similarity.add_(grad_ce.unsqueeze(1))
        grad = exp.mul_(similarity).div_(sum_exp.unsqueeze(1))
    else:
        grad = exp.mul_((grad_ce / sum_exp).unsqueeze(1))
    grad.scatter_add_(
        1, local_target.unsqueeze(1), (-grad_ce * owns_target).unsqueeze(1).to(grad.dtype)
    )
    grad.index_add_(1, local_member, member_grad.to(grad.dtype))
    return grad


class LogitGradientParts(NamedTuple):
    """What backward needs, besides the exp buffer and the incoming gradients, to form the
    gradient of this rank's logit columns (`logit_gradient_`): saved by both
    vocabulary-parallel ops, the unfused one and the fused one (`fused.py`)."""

    sum_exp: torch.Tensor  # [N] sum of exp(z - row max) over every rank's columns
    local_target: torch.Tensor  # [N] long, the target's column here (0 where not owned)
    owns_target: torch.Tensor  # [N] bool, whether this rank owns the target's column
    member_share: torch.Tensor  # [N, K, M] each member's part of its class
    local_member: torch.Tensor  # [K*M] long, each member's column here (0 where not owned)
    owns_member: torch.Tensor  # [K*M] bool
    emo: torch.Tensor  # [N] EMO's transport cost; [0] for the other kinds
    target_embedding: torch.Tensor | None  # [N, h] the target's cost embedding (EMO), else None


class _VocabParallelSaved(NamedTuple):
    """What `_VocabParallelParts` keeps for backward."""

    exp: torch.Tensor  # [N, owned] compute dtype exp(z - row max): becomes the gradient
    parts: LogitGradientParts


class _VocabParallelParts(torch.autograd.Function):
    """logits shard [N, V/tp] -> ce [N], class logits [N, K], target_is_max [N], emo [N]."""

    @staticmethod
    def forward(
        ctx, logits, target, member_ids, member_valid, vocab_start, vocab_size, group, cost
    ):
        dtype = compute_dtype(logits.dtype)
        rows, local_columns = logits.shape
        owned = max(0, min(local_columns, vocab_size - vocab_start))  # real (unpadded) columns
        z = logits[:, :owned]

        # The one saved [N, V/tp] buffer: a float32 copy of half logits, or for float32/64
        # logits a fresh buffer, since the caller's logits are only ever read.
        work = z.to(dtype) if z.dtype != dtype else None
        if owned:
            row_max = (z if work is None else work).amax(dim=-1)
        else:
            row_max = torch.full((rows,), float("-inf"), dtype=dtype, device=logits.device)
        collectives.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        if work is None:
            exp = torch.sub(z, row_max.unsqueeze(1)).exp_()
        else:
            exp = work.sub_(row_max.unsqueeze(1)).exp_()
        owns_target, local_target, owns_member, local_member = local_ids(
            target, member_ids, member_valid, vocab_start, owned
        )

        packed = torch.zeros(rows, 2 + member_ids.numel(), dtype=dtype, device=logits.device)
        if owned:
            packed[:, 0] = exp.sum(dim=-1)
            target_logit = z.gather(1, local_target.unsqueeze(1)).squeeze(1).to(dtype)
            packed[:, 1] = torch.where(owns_target, target_logit, 0.0)
            packed[:, 2:] = torch.where(owns_member, z.index_select(1, local_member).to(dtype), 0.0)
        collectives.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)

        sum_exp = packed[:, 0]
        ce, class_logits, member_share, target_is_max = parts_from_sums(
            sum_exp, packed[:, 1], packed[:, 2:], row_max, member_valid
        )

        emo = torch.zeros(0, dtype=dtype, device=logits.device)
        target_embedding = None
        if cost is not None:
            # [N, 2h]: sum_v exp_v e_v over owned columns, and e_target from its owner.
            local_cost = cost[:owned].to(dtype)
            if owned:
                owned_target = local_cost[local_target] * owns_target.unsqueeze(1)
            else:  # a shard of padding only owns no target (and has no row 0 to index)
                owned_target = torch.zeros(rows, cost.shape[1], dtype=dtype, device=cost.device)
            emo_parts = torch.cat([exp @ local_cost, owned_target], dim=1)
            collectives.all_reduce(emo_parts, op=dist.ReduceOp.SUM, group=group)
            expected, target_embedding = emo_parts.chunk(2, dim=1)
            emo = 1 - (target_embedding * expected).sum(-1) / sum_exp
            ctx.emo_cost = local_cost

        ctx.mark_non_differentiable(target_is_max)
        parts = LogitGradientParts(
            sum_exp=sum_exp,
            local_target=local_target,
            owns_target=owns_target,
            member_share=member_share,
            local_member=local_member,
            owns_member=owns_member,
            emo=emo,
            target_embedding=target_embedding,
        )
        save(ctx, _VocabParallelSaved(exp=exp, parts=parts))
        ctx.layout = (local_columns, logits.dtype)
        ctx.consumed = False
        return ce, class_logits, target_is_max, emo

    @staticmethod
    def backward(ctx, grad_ce, grad_class, _grad_is_max, grad_emo):
        if ctx.consumed:
            raise RuntimeError(
                "vocab_parallel_numeric_loss: backward ran twice through the same graph; its "
                "saved buffer becomes the gradient (as in megatron's CE), so retain_graph "
                "is not supported"
            )
        ctx.consumed = True
        saved = load(ctx, _VocabParallelSaved)
        parts = saved.parts
        local_columns, dtype = ctx.layout
        rows = saved.exp.shape[0]

        member_grad = (grad_class.unsqueeze(-1) * parts.member_share).reshape(rows, -1)
        member_grad = member_grad * parts.owns_member
        emo_parts = None
        if parts.target_embedding is not None:
            emo_parts = (ctx.emo_cost, parts.target_embedding, parts.emo, grad_emo)
        # written into the saved exp buffer
        grad = logit_gradient_(
            saved.exp,
            parts.sum_exp,
            grad_ce,
            parts.local_target,
            parts.owns_target,
            member_grad,
            parts.local_member,
            emo_parts,
        )
        if grad.shape[1] != local_columns:  # padded vocabulary columns: zero gradient
            grad = torch.nn.functional.pad(grad, (0, local_columns - grad.shape[1]))
        return grad.to(dtype), None, None, None, None, None, None, None


def _default_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


@dataclass(frozen=True)
class Prepared:
    """What both vocabulary-parallel ops need before their autograd function: the targets,
    the targets' rows in the logits' [s, b] order, the class members, this rank's slice."""

    targets: Targets
    target_sb: torch.Tensor
    member_ids: torch.Tensor
    member_valid: torch.Tensor
    vocab_start: int
    vocab_size: int
    group: dist.ProcessGroup
    seq: int
    batch: int


def prepare_vocab_parallel(
    shard_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    labels: torch.Tensor,
    vocab: DigitVocab,
    cfg: NumericLossConfig,
    loss_mask: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    cost_embedding: torch.Tensor | None,
    document_starts: torch.Tensor | None = None,
) -> Prepared:
    """Checks and target preparation for logits of shape `shard_shape` [s, b, V/tp];
    document_starts [b, s] as labels (`prepare_targets`)."""
    seq, batch, local_columns = shard_shape
    check_logits_labels(torch.Size((batch, seq, local_columns)), labels, "logits [s, b] as [b, s]")
    group = group if group is not None else _default_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    padded_size = world * local_columns
    vocab_size = vocab.vocab_size if vocab.vocab_size is not None else padded_size
    if vocab_size > padded_size:
        raise ValueError(
            f"logit shards cover {padded_size} vocabulary columns ({world} x {local_columns}) "
            f"but the tokenizer has {vocab_size} tokens"
        )
    if cfg.kind_spec.needs_cost_embedding:
        if cost_embedding is None or cost_embedding.shape[0] != local_columns:
            raise ValueError(
                f"kind='emo' needs cost_embedding: this rank's [{local_columns}, hidden] rows of "
                "emo_cost_embedding(output_layer.weight)"
            )
    targets = prepare_targets(
        labels, vocab, cfg, loss_mask, vocab_size, compute_dtype(dtype), document_starts
    )
    # Logit rows run over [s, b]; target rows over [b, s]: reorder the small tensors only.
    target_sb = to_sb(targets.safe_labels, seq, batch)
    member_ids, member_valid = vocab.class_members(cfg.num_classes, device)
    return Prepared(
        targets,
        target_sb,
        member_ids,
        member_valid,
        rank * local_columns,
        vocab_size,
        group,
        seq,
        batch,
    )


def finish_vocab_parallel(
    prepared: Prepared,
    cfg: NumericLossConfig,
    ce: torch.Tensor,
    class_logits: torch.Tensor,
    target_is_max: torch.Tensor,
    emo: torch.Tensor,
) -> NumericLossOutput:
    """The parts (rows in [s, b] order) assembled into the loss (rows in [b, s] order)."""
    seq, batch = prepared.seq, prepared.batch
    return assemble(
        prepared.targets,
        _to_bs(ce, seq, batch),
        _to_bs(class_logits, seq, batch),
        _to_bs(target_is_max, seq, batch),
        cfg,
        _to_bs(emo, seq, batch) if cfg.kind_spec.needs_cost_embedding else None,
    )


def vocab_parallel_numeric_loss(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab: DigitVocab,
    cfg: NumericLossConfig | None = None,
    loss_mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    cost_embedding: torch.Tensor | None = None,
    document_starts: torch.Tensor | None = None,
) -> NumericLossOutput:
    """`numeric_loss` on this rank's vocabulary shard; per_token is [b, s].

    logits_shard: [s, b, V/tp], this rank's contiguous slice of the (padded) vocabulary;
    labels, loss_mask: [b, s]; group: the tensor-parallel group (default: megatron-core's);
    cost_embedding: this rank's rows [V/tp, h] of the EMO cost embedding (emo only);
    document_starts: [b, s] bool, where packed documents start (numbers end there), or None.
    Every rank returns the same loss, per-token losses and statistics.
    """
    cfg = cfg or NumericLossConfig()
    if logits_shard.dim() != 3:
        raise ValueError(f"logits_shard must be [s, b, V/tp], got {tuple(logits_shard.shape)}")
    seq, batch, local_columns = logits_shard.shape
    prepared = prepare_vocab_parallel(
        logits_shard.shape,
        logits_shard.dtype,
        logits_shard.device,
        labels,
        vocab,
        cfg,
        loss_mask,
        group,
        cost_embedding,
        document_starts,
    )
    ce, class_logits, target_is_max, emo = _VocabParallelParts.apply(
        logits_shard.reshape(seq * batch, local_columns),
        prepared.target_sb,
        prepared.member_ids,
        prepared.member_valid,
        prepared.vocab_start,
        prepared.vocab_size,
        prepared.group,
        cost_embedding if cfg.kind_spec.needs_cost_embedding else None,
    )
    return finish_vocab_parallel(prepared, cfg, ce, class_logits, target_is_max, emo)


def _to_bs(per_row: torch.Tensor, seq: int, batch: int) -> torch.Tensor:
    """[s*b, ...] in [s, b] order -> [b*s, ...] in [b, s] order."""
    rest = per_row.shape[1:]
    return per_row.view(seq, batch, *rest).transpose(0, 1).reshape(-1, *rest)


def to_sb(per_row: torch.Tensor, seq: int, batch: int) -> torch.Tensor:
    """[b*s, ...] in [b, s] order -> [s*b, ...] in [s, b] order (the logits' rows)."""
    rest = per_row.shape[1:]
    return per_row.view(batch, seq, *rest).transpose(0, 1).reshape(-1, *rest)
