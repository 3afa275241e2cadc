"""The output layer fused with the numeric losses on vocabulary shards, in token chunks: no
[tokens, V/tp] logits tensor outlives a chunk, and the gradient is formed in forward.

Per chunk of `chunk_tokens` rows: logits = hidden @ W_shard^T (in the inputs' dtype, as
megatron's output layer makes them), upcast once; this rank's row maximum and the raw target
and digit-class member logits it owns; an all-reduce MAX of the row maxima, then exp(z - M)
in place and one packed all-reduce SUM (sum of exponentials, target logit, member logits,
EMO's expected and target embeddings): the bytes per token of `vocab_parallel_numeric_loss`,
in one MAX and one SUM per chunk. Then, while the chunk's exp buffer is alive, it becomes the
chunk's logit gradient (`logit_gradient_`, shared with the unfused op) for the incoming
gradient predicted from the loss' per-token weights, and the input's gradient and the weight
gradient (float32 for half weights) are accumulated: three products in all, as megatron's
output layer + CE.

Backward scales both by the incoming gradient when it is a multiple of the prediction (as it
is for `loss`, `per_token.sum()` and any 0/1-masked sum of per_token, times any constant):
checked with one host read, or, when the caller promised such a multiple
(`promise_scaled_loss`, the trainer's), with the factor and a device assertion on the device.
Otherwise (another per-token weighting, EMO, whose weight is a ratio of sums over the whole
micro-batch, or `recompute=True`) backward recomputes each chunk's logits and forms the
gradient from the saved statistics, as before. No collective in backward; in a model the
output layer's all-reduce of the input gradient across tensor-parallel ranks comes from
megatron's `copy_to_tensor_model_parallel_region`, as for its own output layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import collectives
from .assemble import NumericLossOutput, compute_dtype
from .config import NumericLossConfig
from .groups import slot_class_logits
from .kinds import Objective, numeric_term
from .saved import load, save
from .targets import SlotSets
from .vocab import DigitVocab
from .vocab_parallel import (
    LogitGradientParts,
    Prepared,
    finish_vocab_parallel,
    local_ids,
    logit_gradient_,
    parts_from_sums,
    prepare_vocab_parallel,
    to_sb,
)


def default_chunk_tokens(device: torch.device) -> int:
    """Tokens per chunk of the fused op when `loss.fused_chunk_tokens` is 0. Each chunk's
    float32 logits [chunk, V/tp] are the op's largest buffer, so the chunk sets its memory;
    the products set its time. CPU: 256, 512 and 1024 tokens ran within 2% of each other
    (docs/benchmarks.md), so the smallest. GPU: 1024 keeps a chunk's logits at about 6% of
    megatron's for 16,384 tokens, and a [1024, h] x [h, V/tp] product is still large enough
    to fill the GPU (not yet measured there)."""
    return 1024 if device.type == "cuda" else 256


@dataclass(frozen=True)
class TokenWeights:
    """What the gradient of `per_token.sum()` with respect to the parts depends on, per row in
    [s, b] order (N rows, m digit slots a row: 1, or a grouped vocabulary's m): known from
    the targets before any logit exists."""

    valid: torch.Tensor  # [N] compute dtype, 1 where the token counts
    classes: torch.Tensor  # [N, m] long, each slot's target class (0 elsewhere)
    weight: torch.Tensor  # [N, m] u * alpha * tokens / numeric count at digit slots, else 0
    slots: SlotSets | None  # grouped digits: each slot's sets, offset [N, m]; else None


def token_weights(prepared: Prepared, cfg: NumericLossConfig, dtype: torch.dtype) -> TokenWeights:
    """The per-token factors of `assemble`'s per_token (docs/losses.md), rows in [s, b] order.
    Only a prediction: backward checks the incoming gradient against it."""
    targets, seq, batch = prepared.targets, prepared.seq, prepared.batch
    m = targets.slots_per_token
    valid = to_sb(targets.valid, seq, batch).to(dtype)
    classes = to_sb(targets.classes.view(-1, m), seq, batch)
    slots = targets.slots
    if slots is not None:
        slots = SlotSets(to_sb(slots.offset, seq, batch), slots.members, slots.valid)
    if cfg.kind_spec.digit_term is None:
        zero = torch.zeros(classes.shape, dtype=dtype, device=valid.device)
        return TokenWeights(valid, classes, zero, slots)
    tokens = targets.valid.sum().to(dtype)
    numeric_count = targets.numeric.sum().to(dtype) if cfg.normalize == "digits" else tokens
    scale = cfg.resolved_alpha * tokens.clamp_min(1) / numeric_count.clamp_min(1)
    # 0 off the digit slots
    weight = to_sb(targets.weights.view(-1, m), seq, batch).to(dtype) * scale
    return TokenWeights(valid, classes, weight, slots)


def predicted_gradients(
    ce: torch.Tensor, class_logits: torch.Tensor, rows: TokenWeights, cfg: NumericLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """d per_token.sum() / d (ce [c], class logits [c, K]) of a chunk's rows (`rows` sliced
    to them): the incoming gradient of `loss`, up to one constant factor. Grouped digits:
    class logits [c, U] of the number tokens, through their slots' set log-sum-exps, as
    `assemble` forms them."""
    grad_ce = rows.valid
    if cfg.kind_spec.objective is Objective.MIXCE:
        # the weight eta + (1 - eta) sg(exp(-CE)) of each token
        grad_ce = (cfg.mixce_eta + (1 - cfg.mixce_eta) * torch.exp(-ce)) * rows.valid
    grad_class = torch.zeros_like(class_logits)
    if cfg.kind_spec.digit_term is not None:
        # every row of the chunk, weighted by 0 off the digit positions: [c, K] is small, and
        # selecting the digit rows would wait for the device on every chunk
        with torch.enable_grad():
            z = class_logits.detach().requires_grad_()
            digit_logits = slot_class_logits(z, rows.slots)  # [c * m, K]
            term = numeric_term(digit_logits, rows.classes.flatten(), cfg) * rows.weight.flatten()
            (grad_class,) = torch.autograd.grad(term.sum(), z)
    return grad_ce, grad_class


def _factor_parts(
    got: list[torch.Tensor], predicted: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: s, 0-dim float64, the least-squares factor of got ~ s * predicted (0
    where predicted is all zero); and whether got == s * predicted elementwise within 256 eps
    of the largest incoming value (the rounding of the two ways of forming it), 0-dim bool.
    Non-finite values pass, as they did when this was read on the host: they reach the
    gradients, and a step with a non-finite gradient is skipped."""
    got_flat = torch.cat([g.reshape(-1) for g in got]).double()
    pred_flat = torch.cat([p.reshape(-1) for p in predicted]).double()
    norm = pred_flat.square().sum()
    scale = torch.where(norm == 0, 0.0, got_flat.dot(pred_flat) / norm)
    largest = got_flat.abs().max()
    residual = (got_flat - scale * pred_flat).abs().max()
    bound = 256 * torch.finfo(got[0].dtype).eps * largest
    # a zero prediction takes only a zero gradient (or a non-finite one, which passes)
    holds = ~(residual > bound) & ((norm != 0) | (largest == 0) | ~torch.isfinite(largest))
    return scale, holds


def common_factor(got: list[torch.Tensor], predicted: list[torch.Tensor]) -> float | None:
    """s with got == s * predicted (`_factor_parts`), or None when there is no such s. One
    host read: the checked path, for a caller that promised nothing of the incoming gradient."""
    if not sum(g.numel() for g in got):
        return 0.0
    scale, holds = _factor_parts(got, predicted)
    scale, holds = torch.stack([scale, holds.double()]).tolist()  # one read, not two
    return scale if holds else None


def promised_factor(got: list[torch.Tensor], predicted: list[torch.Tensor]) -> torch.Tensor:
    """`common_factor` without the host read, for a caller that promised got == s * predicted
    (`promise_scaled_loss`): s as a 0-dim float64 tensor on the device, and the promise checked
    by a device assertion (CUDA: raised at the next synchronisation; CPU: at once), so a
    broken promise fails rather than hand over a wrong gradient."""
    if not sum(g.numel() for g in got):
        return torch.zeros((), dtype=torch.float64, device=got[0].device)
    scale, holds = _factor_parts(got, predicted)
    torch._assert_async(
        holds,
        "vocab_parallel_fused_numeric_loss: the incoming gradient is not one factor times the "
        "loss' own (another weighting of per_token, or a second term on it), against "
        "promise_scaled_loss=True; leave it False for such a backward",
    )
    return scale


@functools.cache  # the probe reads its result to the host: once per (device, dtype)
def addmm_out_dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch accepts `torch.addmm(acc, a, b, out_dtype=float32, out=acc)` with
    half operands on this device (CUDA builds do; CPU 2.13 does not), and sums into `acc`:
    1 + 1 x 1 must give 2. A 1x1 product."""
    acc = torch.ones(1, 1, dtype=torch.float32, device=device)
    one = torch.ones(1, 1, dtype=dtype, device=device)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
    except (NotImplementedError, RuntimeError, TypeError):
        return False
    return bool(acc.item() == 2.0)


def accumulate_weight_grad_(
    accumulator: torch.Tensor,
    grad: torch.Tensor,
    grad_low: torch.Tensor,
    hidden: torch.Tensor,
    out_dtype: bool,
) -> None:
    """accumulator [V_owned, h] += grad^T [V_owned, c] @ hidden [c, h], in place.

    grad: the chunk's logit gradient in the compute dtype; grad_low: the same in the inputs'
    dtype. Half inputs are summed in float32 without a product in their dtype: through
    `addmm(out_dtype=float32)` when `out_dtype` (the probe said so), else in float32 from the
    float32 gradient and an upcast copy of the chunk's hidden rows (both chunk-sized)."""
    if accumulator.dtype == grad_low.dtype:
        accumulator.addmm_(grad_low.T, hidden)
    elif out_dtype:
        torch.addmm(accumulator, grad_low.T, hidden, out_dtype=torch.float32, out=accumulator)
    else:
        accumulator.addmm_(grad.T, hidden.to(accumulator.dtype))


class _FusedSaved(NamedTuple):
    """What `_FusedParts` keeps for backward: its inputs, to make a chunk's logits again
    (`_recomputed`), and the row statistics to form their gradient from."""

    hidden: torch.Tensor  # [N, h] the output layer's input
    weight: torch.Tensor  # [V/tp, h] this rank's rows of the output weight
    row_max: torch.Tensor  # [N] compute dtype, every rank's row maximum
    parts: LogitGradientParts


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
        plan,
    ):
        """plan: (TokenWeights, cfg, which gradients to form in forward: (hidden, weight),
        whether the caller promised backward the loss' own gradient times one factor) or None
        to form none (recompute in backward, or no backward at all)."""
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
        h_emb = local_cost.shape[1] if local_cost is not None else 0

        w = weight[:owned]
        row_max = torch.full((rows,), float("-inf"), dtype=dtype, device=device)
        # per token: sum of exponentials, target logit, member logits, [EMO: expected and
        # target embeddings]; summed over ranks, one chunk's rows at a time
        packed = torch.zeros(rows, base + 2 * h_emb, dtype=dtype, device=device)
        ce = torch.empty(rows, dtype=dtype, device=device)
        class_logits = torch.empty(rows, *member_valid.shape[:1], dtype=dtype, device=device)
        member_share = torch.empty(rows, *member_valid.shape, dtype=dtype, device=device)
        target_is_max = torch.empty(rows, dtype=torch.bool, device=device)
        emo = torch.zeros(rows if cost is not None else 0, dtype=dtype, device=device)

        grad_hidden = weight_grad = predicted = None
        if plan is not None:
            weights, cfg, (form_hidden, form_weight), promised = plan
            predicted = (
                torch.zeros(rows, dtype=dtype, device=device),
                torch.zeros_like(class_logits),
            )
            if form_hidden:
                grad_hidden = torch.zeros(rows, hidden.shape[1], dtype=dtype, device=device)
            if form_weight:
                weight_grad = torch.zeros(weight.shape, dtype=dtype, device=device)
                out_dtype = dtype != hidden.dtype and addmm_out_dtype_supported(
                    device, hidden.dtype
                )

        for start in range(0, rows, chunk):
            c = slice(start, min(start + chunk, rows))
            part = packed[c]
            if owned:
                z = (hidden[c] @ w.T).to(dtype)  # [c, owned], the chunk's logits
                # the raw target and member logits first (exact, however far below the max)
                target_logit = z.gather(1, local_target[c].unsqueeze(1)).squeeze(1)
                part[:, 1] = torch.where(owns_target[c], target_logit, 0.0)
                members = z.index_select(1, local_member)
                part[:, 2:base] = torch.where(owns_member, members, 0.0)
                row_max[c] = z.amax(dim=-1)
            collectives.all_reduce(row_max[c], op=dist.ReduceOp.MAX, group=group)
            if owned:
                exp = z.sub_(row_max[c].unsqueeze(1)).exp_()  # z is the chunk's own buffer
                part[:, 0] = exp.sum(dim=-1)
                if local_cost is not None:
                    part[:, base : base + h_emb] = exp @ local_cost
                    part[:, base + h_emb :] = local_cost[local_target[c]] * owns_target[
                        c
                    ].unsqueeze(1)
            collectives.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
            ce[c], class_logits[c], member_share[c], target_is_max[c] = parts_from_sums(
                part[:, 0], part[:, 1], part[:, 2:base], row_max[c], member_valid
            )
            if local_cost is not None:
                expected, embedding = part[:, base : base + h_emb], part[:, base + h_emb :]
                emo[c] = 1 - (embedding * expected).sum(-1) / part[:, 0]
            if plan is not None:
                grad_ce, grad_class = predicted_gradients(
                    ce[c], class_logits[c], _rows(weights, c), cfg
                )
                predicted[0][c], predicted[1][c] = grad_ce, grad_class
                if owned:
                    member_grad = (grad_class.unsqueeze(-1) * member_share[c]).reshape(
                        grad_class.shape[0], -1
                    ) * owns_member
                    grad = logit_gradient_(
                        exp, part[:, 0], grad_ce, local_target[c], owns_target[c],
                        member_grad, local_member,
                    )  # fmt: skip
                    # as the unfused op hands its gradient to the output layer's matmul
                    grad_low = grad.to(hidden.dtype)
                    if grad_hidden is not None:
                        grad_hidden[c] = grad_low @ w
                    if weight_grad is not None:
                        accumulate_weight_grad_(
                            weight_grad[:owned], grad, grad_low, hidden[c], out_dtype
                        )
                    del grad, grad_low
            if owned:
                del z, exp  # or this chunk's buffer outlives the next chunk's product

        sum_exp = packed[:, 0]
        target_embedding = packed[:, base + h_emb :] if local_cost is not None else None
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
        save(ctx, _FusedSaved(hidden=hidden, weight=weight, row_max=row_max, parts=parts))
        ctx.owned, ctx.chunk = owned, chunk
        ctx.formed = (predicted, grad_hidden, weight_grad, promised) if plan is not None else None
        ctx.consumed = False
        return ce, class_logits, target_is_max, emo

    @staticmethod
    def backward(ctx, grad_ce, grad_class, _grad_is_max, grad_emo):
        if ctx.consumed:
            raise RuntimeError(
                "vocab_parallel_fused_numeric_loss: backward ran twice through the same graph; "
                "its gradients are formed once and handed over, so retain_graph is not supported"
            )
        ctx.consumed = True
        formed, ctx.formed = ctx.formed, None  # released as soon as they are handed over
        saved = load(ctx, _FusedSaved)
        hidden, weight = saved.hidden, saved.weight
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        if formed is not None:
            predicted, grad_hidden, weight_grad, promised = formed
            got = [grad_ce, grad_class] + ([grad_emo] if grad_emo.numel() else [])
            want = list(predicted) + ([torch.zeros_like(grad_emo)] if grad_emo.numel() else [])
            formed_all = (grad_hidden is not None or not want_hidden) and (
                weight_grad is not None or not want_weight
            )
            if promised and formed_all:  # no host read: the factor stays on the device
                factor = promised_factor(got, want)
                return _handover(hidden, weight, grad_hidden, weight_grad, factor)
            factor = common_factor(got, want) if formed_all else None
            if factor is not None:
                return _handover(hidden, weight, grad_hidden, weight_grad, factor)
            # another weighting of the tokens: recompute, summing into the same buffer
            accumulator = weight_grad.zero_() if weight_grad is not None else None
            del formed, predicted, grad_hidden, weight_grad
        else:
            accumulator = None
        grad_hidden, weight_grad = _recomputed(
            ctx, saved, grad_ce, grad_class, grad_emo, want_hidden, want_weight, accumulator
        )
        return _handover(hidden, weight, grad_hidden, weight_grad, 1.0)


def _rows(weights: TokenWeights, c: slice) -> TokenWeights:
    slots = weights.slots
    if slots is not None:
        slots = SlotSets(slots.offset[c], slots.members, slots.valid)
    return TokenWeights(weights.valid[c], weights.classes[c], weights.weight[c], slots)


def _recomputed(
    ctx, saved: _FusedSaved, grad_ce, grad_class, grad_emo, want_hidden, want_weight, accumulator
):
    """The gradients of hidden [N, h] and of the weight shard [V/tp, h] (compute dtype) for
    any incoming gradient: each chunk's logits made again, its gradient formed from the
    saved statistics as the unfused op forms it. A fourth product."""
    hidden, weight, parts = saved.hidden, saved.weight, saved.parts
    owned, chunk = ctx.owned, ctx.chunk
    dtype = compute_dtype(hidden.dtype)
    rows = hidden.shape[0]
    grad_hidden = (
        torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if want_hidden else None
    )
    weight_grad = None
    if want_weight:
        weight_grad = accumulator
        if weight_grad is None:  # summed straight into a float32 `.grad` when there is one
            weight_grad = _existing_grad(weight)
            if weight_grad is None or weight_grad.dtype != dtype:
                weight_grad = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        out_dtype = dtype != hidden.dtype and addmm_out_dtype_supported(hidden.device, hidden.dtype)
    if not owned:
        return grad_hidden, weight_grad
    w = weight[:owned]
    member_grad = (grad_class.unsqueeze(-1) * parts.member_share).reshape(rows, -1)
    member_grad = member_grad * parts.owns_member
    for start in range(0, rows, chunk):
        c = slice(start, min(start + chunk, rows))
        h = hidden[c]
        z = (h @ w.T).to(dtype)
        emo_parts = None
        if parts.target_embedding is not None:
            emo_parts = (ctx.emo_cost, parts.target_embedding[c], parts.emo[c], grad_emo[c])
        exp = z.sub_(saved.row_max[c].unsqueeze(1)).exp_()  # in z's own buffer
        grad = logit_gradient_(
            exp, parts.sum_exp[c], grad_ce[c], parts.local_target[c], parts.owns_target[c],
            member_grad[c], parts.local_member, emo_parts,
        )  # fmt: skip
        grad_low = grad.to(hidden.dtype)
        if grad_hidden is not None:
            grad_hidden[c] = grad_low @ w
        if weight_grad is not None:
            accumulate_weight_grad_(weight_grad[:owned], grad, grad_low, h, out_dtype)
        del z, exp, grad, grad_low  # one chunk buffer at a time
    return grad_hidden, weight_grad


def _handover(hidden, weight, grad_hidden, weight_grad, factor: float | torch.Tensor):
    """The gradients, times `factor` (a number, or a 0-dim tensor on the device: never read
    here), in the inputs' dtypes; see _weight_gradient."""
    scaled = isinstance(factor, torch.Tensor) or factor != 1.0
    if grad_hidden is not None:
        if scaled:
            grad_hidden.mul_(factor)
        grad_hidden = grad_hidden.to(hidden.dtype)
    if weight_grad is not None:
        if scaled:
            weight_grad.mul_(factor)
        weight_grad = _weight_gradient(weight, weight_grad)
    return grad_hidden, weight_grad, *([None] * 9)


def _weight_gradient(weight: torch.Tensor, summed: torch.Tensor) -> torch.Tensor:
    """What autograd is handed for the weight, given the summed gradient `summed` [V/tp, h]
    (compute dtype). In the weight's dtype it is returned as is: AccumulateGrad takes it as
    `.grad` when there is none (DeepSpeed ZeRO 2/3 free `.grad` after each reduction) or adds
    it in place (ZeRO 1 accumulating micro-batches). A float32 sum for a half weight would
    make autograd cast it, a weight-sized tensor in the half dtype beside the float32 one; so
    when the weight is a leaf holding a `.grad`, the sum is added into it in row blocks and
    autograd gets a zero that costs no memory (stride 0), which AccumulateGrad adds; its
    post-accumulate hooks (DeepSpeed's reduction) read the summed `.grad` as usual. The same
    zero when the recomputing backward summed into a float32 `.grad` itself. Hooks on the
    weight tensor (`register_hook`) see the zero in those cases. Under megatron's
    DistributedDataParallel (a `main_grad` float32 buffer beside the weight) a sum in another
    dtype than the weight's is added into `main_grad` and the weight marked
    `grad_added_to_main_grad`, as megatron's own linear layers do with gradient-accumulation
    fusion: no rounding to the half dtype before the float32 buffer (megatron's hook would add
    a half `.grad` into it), and autograd gets the zero, which the hook then drops. Otherwise
    one cast."""
    existing = _existing_grad(weight)
    zero = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
    if summed is existing:  # the recomputing path summed into it already
        return zero
    if summed.dtype != weight.dtype and hasattr(weight, "grad_added_to_main_grad"):
        weight.main_grad.add_(summed)
        weight.grad_added_to_main_grad = True
        return zero
    if summed.dtype == weight.dtype:
        return summed
    if existing is None:
        return summed.to(weight.dtype)
    # a mixed-dtype in-place add may stage its result in the wider dtype (CPU does): blocks
    # of rows bound that to a block instead of the whole weight
    block = max(1, (1 << 22) // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], block):
        existing[start : start + block].add_(summed[start : start + block])
    return zero


def _existing_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's own `.grad` [V/tp, h] when gradients may be summed into it in place: a
    leaf, a dense contiguous buffer of its shape, and no graph being built of the backward."""
    if not weight.is_leaf or not weight.requires_grad or torch.is_grad_enabled():
        return None
    existing = weight.grad
    if (
        existing is None
        or existing.shape != weight.shape
        or existing.layout != torch.strided
        or not existing.is_contiguous()
    ):
        return None
    return existing


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
    chunk_tokens: int | None = None,
    recompute: bool = False,
    promise_scaled_loss: bool = False,
    document_starts: torch.Tensor | None = None,
) -> NumericLossOutput:
    """`vocab_parallel_numeric_loss(hidden @ output_weight_shard.T, ...)` without the logits.

    hidden: [s, b, h] (the output layer's input, not sequence-parallel); output_weight_shard:
    [V/tp, h], this rank's rows of the (padded) vocabulary; labels, loss_mask: [b, s];
    document_starts: [b, s] bool, where packed documents start (numbers end there), or None.
    Gradients flow to `hidden` (this rank's part, as for the product) and the weight shard.
    chunk_tokens: rows per chunk; None: `default_chunk_tokens(hidden.device)`, the one default
    (a model's `loss.fused_chunk_tokens: 0` comes here through `NumericLossHead`).
    recompute: form no gradient in forward (hold no float32 [V/tp, h] weight gradient from
    forward to backward) and make each chunk's logits again in backward: a fourth product.
    promise_scaled_loss: the caller promises that backward gets the gradient of `loss`
    (equally, of a 0/1-masked sum of `per_token` with the loss mask given here) times one
    factor, as the trainer's `engine.backward(loss_sum * scale)` does. The gradient formed in
    forward is then scaled on the device and the promise checked by a device assertion: no
    host read. False (the default): backward reads once whether the incoming gradient is
    such a multiple, and recomputes when it is not (any other use of the outputs).
    """
    cfg = cfg or NumericLossConfig()
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [s, b, h], got {tuple(hidden.shape)}")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(hidden.device)
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
        document_starts,
    )
    wanted = (hidden.requires_grad, output_weight_shard.requires_grad)
    plan = None
    known = cfg.kind_spec.per_token_weights_known_in_forward
    if torch.is_grad_enabled() and any(wanted) and not recompute and known:
        weights = token_weights(prepared, cfg, compute_dtype(hidden.dtype))
        plan = (weights, cfg, wanted, promise_scaled_loss)
    ce, class_logits, target_is_max, emo = _FusedParts.apply(
        hidden.reshape(seq * batch, width),
        output_weight_shard,
        prepared.target_sb,
        prepared.member_ids,
        prepared.member_valid,
        prepared.vocab_start,
        prepared.vocab_size,
        prepared.group,
        cost_embedding if cfg.kind_spec.needs_cost_embedding else None,
        chunk_tokens,
        plan,
    )
    return finish_vocab_parallel(prepared, cfg, ce, class_logits, target_is_max, emo)
