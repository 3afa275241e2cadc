"""The output layer fused with the numeric losses on vocabulary shards, in token chunks: no
[tokens, V/tp] logits tensor outlives a chunk.

Forward, per chunk of `chunk_tokens` rows: logits = hidden @ W_shard^T (in the inputs' dtype,
as megatron's output layer makes them), upcast once, then this rank's row maximum, the sum
of exponentials relative to it, the target logit and the digit-class member logits it owns
(and EMO's expected embedding). After the last chunk the same two collectives as
`vocab_parallel_numeric_loss`: an all-reduce MAX of the row maxima, then one packed
all-reduce SUM in which each rank's sum of exponentials is rescaled to the global maximum
(the log-sum-exp of two partial softmaxes, as in online softmax). Only per-token statistics
are kept.

Backward, per chunk: the logits are recomputed, the gradient of that chunk's logits is formed
from the saved statistics exactly as the unfused op forms it, and gradients of `hidden` (this
rank's partial sum over its vocabulary shard, as for `hidden @ W_shard^T`) and of `W_shard`
are accumulated. No collective in backward; in a model the output layer's all-reduce of the
input gradient across tensor-parallel ranks comes from megatron's
`copy_to_tensor_model_parallel_region`, as for its own output layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives
from .assemble import NumericLossOutput, compute_dtype
from .config import NumericLossConfig
from .vocab import DigitVocab
from .vocab_parallel import (
    finish_vocab_parallel,
    local_ids,
    logit_gradient_,
    parts_from_sums,
    prepare_vocab_parallel,
)

DEFAULT_CHUNK_TOKENS = 1024


class _FusedParts(torch.autograd.Function):
    """hidden [N, h], weight shard [V/tp, h] -> ce [N], class logits [N, K], target_is_max
    [N], emo [N]; the same outputs as _VocabParallelParts on hidden @ weight^T."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        member_ids,
        member_valid,
        vocab_start,
        vocab_size,
        group,
        cost,
        chunk,
    ):
        dtype = compute_dtype(hidden.dtype)
        rows = hidden.shape[0]
        local_columns = weight.shape[0]
        owned = max(0, min(local_columns, vocab_size - vocab_start))
        device = hidden.device
        owns_target, local_target, owns_member, local_member = local_ids(
            target, member_ids, member_valid, vocab_start, owned
        )
        members_width = member_ids.numel()
        base = 2 + members_width  # where EMO's two embeddings start in the packed row
        local_cost = cost[:owned].to(dtype) if cost is not None else None

        w = weight[:owned]
        row_max = torch.full((rows,), float("-inf"), dtype=dtype, device=device)
        h_emb = local_cost.shape[1] if local_cost is not None else 0
        # per token: sum of exponentials, target logit, member logits, [EMO: expected and
        # target embeddings]; summed over ranks in one all-reduce
        packed = torch.zeros(rows, base + 2 * h_emb, dtype=dtype, device=device)
        if owned:
            for start in range(0, rows, chunk):
                stop = min(start + chunk, rows)
                z = (hidden[start:stop] @ w.T).to(dtype)  # [c, owned], the chunk's logits
                part = packed[start:stop]
                # the raw target and member logits first (exact, however far below the max)
                target_logit = z.gather(1, local_target[start:stop].unsqueeze(1)).squeeze(1)
                part[:, 1] = torch.where(owns_target[start:stop], target_logit, 0.0)
                members = z.index_select(1, local_member)
                part[:, 2 : 2 + members_width] = torch.where(owns_member, members, 0.0)
                m = z.amax(dim=-1)
                row_max[start:stop] = m
                exp = z.sub_(m.unsqueeze(1)).exp_()  # z is the chunk's own buffer
                part[:, 0] = exp.sum(dim=-1)
                if local_cost is not None:
                    part[:, base : base + h_emb] = exp @ local_cost
                    part[:, base + h_emb :] = local_cost[local_target[start:stop]] * owns_target[
                        start:stop
                    ].unsqueeze(1)
                del z, exp  # or this chunk's buffer outlives the next chunk's product
        global_max = row_max.clone()
        collectives.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        rescale = torch.exp(row_max - global_max)  # 0 where this rank owns no column
        packed[:, 0] *= rescale
        if local_cost is not None:
            packed[:, base : base + h_emb] *= rescale.unsqueeze(1)
        collectives.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)

        sum_exp = packed[:, 0]
        ce, class_logits, member_share, target_is_max = parts_from_sums(
            sum_exp, packed[:, 1], packed[:, 2 : 2 + members_width], global_max, member_valid
        )

        emo = torch.zeros(0, dtype=dtype, device=device)
        target_embedding = None
        if local_cost is not None:
            expected = packed[:, base : base + h_emb]
            target_embedding = packed[:, base + h_emb :]
            emo = 1 - (target_embedding * expected).sum(-1) / sum_exp
            ctx.emo_cost = local_cost

        ctx.mark_non_differentiable(target_is_max)
        ctx.save_for_backward(
            hidden,
            weight,
            global_max,
            sum_exp,
            local_target,
            owns_target,
            member_share,
            local_member,
            owns_member,
            emo,
            target_embedding,
        )
        ctx.owned, ctx.chunk = owned, chunk
        return ce, class_logits, target_is_max, emo

    @staticmethod
    def backward(ctx, grad_ce, grad_class, _grad_is_max, grad_emo):
        (
            hidden,
            weight,
            global_max,
            sum_exp,
            local_target,
            owns_target,
            member_share,
            local_member,
            owns_member,
            emo,
            target_embedding,
        ) = ctx.saved_tensors
        owned, chunk = ctx.owned, ctx.chunk
        dtype = compute_dtype(hidden.dtype)
        rows = hidden.shape[0]
        grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        weight_grad = _WeightGradient(weight, dtype)
        if not owned:
            return grad_hidden.to(hidden.dtype), weight_grad.result(), *([None] * 8)
        w = weight[:owned]
        accumulator = weight_grad.accumulator[:owned]
        member_grad = (grad_class.unsqueeze(-1) * member_share).reshape(rows, -1) * owns_member
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            h = hidden[start:stop]
            z = (h @ w.T).to(dtype)
            c = slice(start, stop)
            emo_parts = None
            if target_embedding is not None:
                emo_parts = (ctx.emo_cost, target_embedding[c], emo[c], grad_emo[c])
            exp = z.sub_(global_max[c].unsqueeze(1)).exp_()  # in z's own buffer
            grad = logit_gradient_(
                exp,
                sum_exp[c],
                grad_ce[c],
                local_target[c],
                owns_target[c],
                member_grad[c],
                local_member,
                emo_parts,
            )
            grad = grad.to(hidden.dtype)  # as the unfused op hands its gradient to the matmul
            grad_hidden[start:stop] = grad @ w
            if accumulator.dtype == grad.dtype:
                accumulator.addmm_(grad.T, h)
            else:  # half inputs: the chunk's product in their dtype, summed in float32
                accumulator += grad.T @ h
            del z, exp, grad  # one chunk buffer at a time
        return grad_hidden.to(hidden.dtype), weight_grad.result(), *([None] * 8)


class _WeightGradient:
    """Where the chunks' weight gradients [V/tp, h] are summed.

    Training holds the parameter's `.grad` between micro-batches (or DeepSpeed hands it a
    fresh one each backward). When it is there, the chunks are summed into it (a half
    `.grad`: summed in float32, then added once) and autograd is handed a zero that costs no
    memory (stride 0), so no second weight-sized tensor exists; AccumulateGrad adds that
    zero, and its hooks (DeepSpeed's reduction) read the summed `.grad` as usual. Otherwise
    (no `.grad`, a non-leaf weight, double backward) the buffer summed into is returned, as a
    plain autograd function would. Hooks on the weight tensor itself (`register_hook`) see
    the zero in the first case.
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.weight = weight
        existing = None
        if weight.is_leaf and weight.requires_grad and not torch.is_grad_enabled():
            existing = weight.grad
        if existing is not None and (
            existing.shape != weight.shape or existing.layout != torch.strided
        ):
            existing = None
        self.existing = existing
        if existing is not None and existing.dtype == dtype:
            self.accumulator = existing
        else:
            self.accumulator = torch.zeros(weight.shape, dtype=dtype, device=weight.device)

    def result(self) -> torch.Tensor:
        if self.existing is None:
            return self.accumulator.to(self.weight.dtype)
        if self.accumulator is not self.existing:
            self.existing.add_(self.accumulator)  # the float32 sum, rounded once
        zero = torch.zeros((), dtype=self.weight.dtype, device=self.weight.device)
        return zero.expand(self.weight.shape)


def vocab_parallel_fused_numeric_loss(
    hidden: torch.Tensor,
    output_weight_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab: DigitVocab,
    cfg: NumericLossConfig | None = None,
    loss_mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    cost_embedding: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> NumericLossOutput:
    """`vocab_parallel_numeric_loss(hidden @ output_weight_shard.T, ...)` without the logits.

    hidden: [s, b, h] (the output layer's input, not sequence-parallel); output_weight_shard:
    [V/tp, h], this rank's rows of the (padded) vocabulary; labels, loss_mask: [b, s].
    Gradients flow to `hidden` (this rank's part, as for the product) and the weight shard.
    """
    cfg = cfg or NumericLossConfig()
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [s, b, h], got {tuple(hidden.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    seq, batch, width = hidden.shape
    if output_weight_shard.dim() != 2 or output_weight_shard.shape[1] != width:
        raise ValueError(
            f"output_weight_shard must be [V/tp, {width}], got {tuple(output_weight_shard.shape)}"
        )
    local_columns = output_weight_shard.shape[0]
    prepared = prepare_vocab_parallel(
        torch.Size((seq, batch, local_columns)),
        hidden.dtype,
        hidden.device,
        labels,
        vocab,
        cfg,
        loss_mask,
        group,
        cost_embedding,
    )
    ce, class_logits, target_is_max, emo = _FusedParts.apply(
        hidden.reshape(seq * batch, width),
        output_weight_shard,
        prepared.target_sb,
        prepared.member_ids,
        prepared.member_valid,
        prepared.vocab_start,
        prepared.vocab_size,
        prepared.group,
        cost_embedding if cfg.kind == "emo" else None,
        chunk_tokens,
    )
    return finish_vocab_parallel(prepared, cfg, ce, class_logits, target_is_max, emo)
