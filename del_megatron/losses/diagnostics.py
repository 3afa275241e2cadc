"""How much of the loss' gradient at the output layer is the numeric term's: the probe of
docs/losses.md, "Is DEL learned from or escaped? (diagnostics)".

DEL's term is a BCE on raw digit-class logits: a model can lower it by shifting every logit
down, which softmax (CE, the digit distribution) ignores. Whether the term still moves the
model is read from its gradient: `numeric_grad_share` = ||∇(α·numeric)|| / ||∇loss|| and
`numeric_grad_cos` = cos(∇(α·numeric), ∇CE), both taken with respect to the output layer's
logits of one micro-batch.

Why the logits and not the output weight: the logits are the output layer's own output, the
same tensor on every data layout (under ZeRO 3 the weight is partitioned over data-parallel
ranks and its gradient reduced into those partitions, so its norm would need a gather), and
the term reaches the rest of the model only through them (the weight's gradient is
hiddenᵀ·∂logits). With `loss.fused_output` the logits never exist as a tensor: there is no
probe then (nothing is reported, rather than a made-up value).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import collectives
from .assemble import NumericLossOutput, compute_dtype

# Metric name -> (sum key, count key) of the probe's statistics: a mean over the micro-batches
# probed (one per data-parallel rank on a log step).
GRAD_PROBE_PAIRS = {
    "numeric_grad_share": ("numeric_grad_share_sum", "numeric_grad_probes"),
    "numeric_grad_cos": ("numeric_grad_cos_sum", "numeric_grad_cos_probes"),
}


def output_gradient_probe(
    loss_of: Callable[[torch.Tensor], NumericLossOutput],
    logits: torch.Tensor,
    alpha: float,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """The numeric term's share of the gradient at `logits`, as 0-dim float64 sums and counts
    (GRAD_PROBE_PAIRS' keys), on the logits' device, no host read.

    loss_of: the loss on a copy of the logits (the same op, labels and mask as the step's):
    called twice, on two detached copies, since the ops' backward writes its gradient into
    their saved buffer and runs once a graph. logits: this rank's logits (any shape; under
    tensor parallelism its vocabulary shard); group: the tensor-parallel group, over which
    the sums of squares and the dot product are all-reduced (None: one process), so that
    every rank gets the value of the unsharded logits. The kind must have a digit term:
    loss = CE + alpha·numeric.

    Cost: two forwards and backwards of the loss op alone (no layer of the model) on one
    micro-batch; two float32 buffers of the logits' size held at once (the two gradients).
    """
    dtype = compute_dtype(logits.dtype)  # bf16 logits: the gradients' norms in float32
    grads = []
    for part in ("ce", "numeric"):
        probe = logits.detach().to(dtype).requires_grad_(True)
        out = loss_of(probe)
        value = out.ce if part == "ce" else alpha * out.numeric
        grad = None
        if value.requires_grad:  # (a kind without a digit term: a constant 0)
            (grad,) = torch.autograd.grad(value, probe, allow_unused=True)
        grads.append(torch.zeros_like(probe) if grad is None else grad)
    g_ce, g_num = grads
    g_loss = g_ce + g_num  # loss = ce + alpha * numeric for the kinds with a digit term
    sums = torch.stack(
        [g_ce.square().sum(), g_num.square().sum(), g_loss.square().sum(), (g_ce * g_num).sum()]
    ).to(torch.float64)
    collectives.all_reduce(sums, group=group)  # vocabulary shards: sums over every column
    ce2, num2, loss2, dot = sums.unbind()
    tiny = torch.finfo(torch.float64).tiny
    # a micro-batch whose gradient is zero (no valid token) or whose term's is (no digit
    # position) counts 0 times instead of adding a 0/0
    share_count = (loss2 > 0).to(torch.float64)
    cos_count = ((ce2 > 0) & (num2 > 0)).to(torch.float64)
    share = torch.sqrt(num2 / loss2.clamp_min(tiny)) * share_count
    cos = dot / torch.sqrt((ce2 * num2).clamp_min(tiny)) * cos_count
    return {
        "numeric_grad_share_sum": share,
        "numeric_grad_probes": share_count,
        "numeric_grad_cos_sum": cos,
        "numeric_grad_cos_probes": cos_count,
    }


def probe_pairs(stats: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The probe's metric -> (sum, count), for the statistics that hold it (a probed
    micro-batch's); {} otherwise."""
    return {name: (stats[s], stats[c]) for name, (s, c) in GRAD_PROBE_PAIRS.items() if s in stats}
