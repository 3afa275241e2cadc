"""Per-position numeric terms on digit-class logits: the math of every loss kind.

Pure functions on small tensors: class_logits [n, K] (K = 10, or 11 with '.'), target class
[n] long, digit values v_k = k. Each returns l_t [n]; place weights are applied by the caller.
Which term a loss kind uses: `kinds.KINDS`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _digit_distance(class_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """|v_k - y| [n, K] for the ten digit classes."""
    values = torch.arange(class_logits.shape[-1], device=target.device, dtype=class_logits.dtype)
    return (values - target.to(class_logits.dtype).unsqueeze(-1)).abs()


def del_term(
    class_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    detach_criterion: bool,
    distance: bool,
    shift_invariant: bool = False,
) -> torch.Tensor:
    """Supervised digit entropy (1/K) sum_k p_k * BCE(z_k, 1[k=y]); times |v_k-y| if distance.
    shift_invariant: the BCE on z_k - mean_j z_j (ours; the authors' reads z_k itself)."""
    num_classes = class_logits.shape[-1]
    p_hat = torch.softmax(class_logits, dim=-1)
    if detach_criterion:
        p_hat = p_hat.detach()
    onehot = F.one_hot(target, num_classes).to(class_logits.dtype)
    bce_logits = class_logits
    if shift_invariant:
        bce_logits = class_logits - class_logits.mean(-1, keepdim=True)
    bce = F.binary_cross_entropy_with_logits(bce_logits, onehot, reduction="none")
    per_class = p_hat * bce
    if distance:
        per_class = per_class * _digit_distance(class_logits, target)
    return per_class.sum(-1) / num_classes


def ntl_was_term(class_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Number Token Loss, Wasserstein form: sum_k p_k |v_k - y|."""
    return (torch.softmax(class_logits, -1) * _digit_distance(class_logits, target)).sum(-1)


def ntl_mse_term(class_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Number Token Loss, dot-product form: (sum_k p_k v_k - y)^2."""
    values = torch.arange(class_logits.shape[-1], device=target.device, dtype=class_logits.dtype)
    expected = torch.softmax(class_logits, -1) @ values
    return (expected - target.to(class_logits.dtype)) ** 2


def dist2_term(class_logits: torch.Tensor, target: torch.Tensor, *, tau: float) -> torch.Tensor:
    """Discretized distance loss: KL(q || p), q_k ~ exp(-(v_k - y)^2 / tau)."""
    log_q = torch.log_softmax(-(_digit_distance(class_logits, target) ** 2) / tau, dim=-1)
    log_p = torch.log_softmax(class_logits, dim=-1)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def digit_entropy(class_logits: torch.Tensor) -> torch.Tensor:
    """-sum_k p_k log p_k [n] of the digit conditional distribution."""
    log_p = torch.log_softmax(class_logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)
