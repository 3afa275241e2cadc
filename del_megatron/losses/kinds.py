"""Every loss kind and what it is made of, in one table (`KINDS`).

Code asks the table what a kind does (`cfg.kind_spec`); nothing else compares kind names. A
kind is a token-level objective (plain CE, MixCE's or EMO's reweighting of it), optionally
plus a digit term l_t on the digit-class logits at digit positions (docs/losses.md).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

import torch

from .terms import del_term, dist2_term, ntl_mse_term, ntl_was_term

if TYPE_CHECKING:
    from .config import NumericLossConfig

LossKind = Literal["mle", "del", "del_distance", "ntl_was", "ntl_mse", "dist2", "mixce", "emo"]

# class logits [n, K], target classes [n], the options -> l_t [n]
DigitTerm = Callable[[torch.Tensor, torch.Tensor, "NumericLossConfig"], torch.Tensor]


class Objective(enum.Enum):
    """The token-level objective a kind sums over unmasked tokens."""

    CE = "ce"
    MIXCE = "mixce"  # eta*CE + (1 - eta)*sg(exp(-CE))*CE
    EMO = "emo"  # 0.5*(CE + sg(CE_sum / emo_sum)*emo), emo the transport cost


@dataclass(frozen=True)
class Kind:
    """What one `loss.kind` is made of."""

    objective: Objective = Objective.CE
    digit_term: DigitTerm | None = None
    """l_t at digit positions; None: the kind has no digit part (alpha is 0)."""
    default_alpha: float = 0.0
    """Coefficient of the digit part when `alpha` is not given."""
    place_weighting: bool = False
    """Whether digit positions are weighed by u(place) when `place_weighting` is not given."""
    decimal_point_class: bool = False
    """Whether '.' may be an eleventh class (`include_decimal_point`)."""
    bce_on_logits: bool = False
    """Whether the digit term reads the class logits themselves (DEL's BCE), not only the
    distribution they make: only such a term can be shift-invariant or not
    (`shift_invariant`)."""

    @property
    def needs_cost_embedding(self) -> bool:
        """EMO's transport cost needs the frozen cost embedding of the output weights."""
        return self.objective is Objective.EMO

    @property
    def per_token_weights_known_in_forward(self) -> bool:
        """Whether d per_token.sum() / d CE_t is known per token before the whole
        micro-batch's logits exist (the fused op forms the gradient in forward then). Not for
        EMO: its weight is a ratio of sums over every token of the micro-batch."""
        return self.objective is not Objective.EMO


def _del(class_logits, target, cfg):
    return del_term(
        class_logits,
        target,
        detach_criterion=cfg.detach_criterion,
        distance=False,
        shift_invariant=cfg.shift_invariant,
    )


def _del_distance(class_logits, target, cfg):
    return del_term(
        class_logits,
        target,
        detach_criterion=cfg.detach_criterion,
        distance=True,
        shift_invariant=cfg.shift_invariant,
    )


def _ntl_was(class_logits, target, cfg):
    return ntl_was_term(class_logits, target)


def _ntl_mse(class_logits, target, cfg):
    return ntl_mse_term(class_logits, target)


def _dist2(class_logits, target, cfg):
    return dist2_term(class_logits, target, tau=cfg.dist2_tau)


# Default alphas: the DEL authors' 0.1, the NTL paper's 0.3, the DIST2 paper's 0.1.
KINDS: dict[str, Kind] = {
    "mle": Kind(),
    "del": Kind(
        digit_term=_del,
        default_alpha=0.1,
        place_weighting=True,
        decimal_point_class=True,
        bce_on_logits=True,
    ),
    "del_distance": Kind(
        digit_term=_del_distance, default_alpha=0.1, place_weighting=True, bce_on_logits=True
    ),
    "ntl_was": Kind(digit_term=_ntl_was, default_alpha=0.3),
    "ntl_mse": Kind(digit_term=_ntl_mse, default_alpha=0.3),
    "dist2": Kind(digit_term=_dist2, default_alpha=0.1),
    "mixce": Kind(objective=Objective.MIXCE),
    "emo": Kind(objective=Objective.EMO),
}
assert set(KINDS) == set(get_args(LossKind)), "KINDS and LossKind name the same kinds"


def numeric_term(
    class_logits: torch.Tensor, target: torch.Tensor, cfg: NumericLossConfig
) -> torch.Tensor:
    """l_t [n] of cfg.kind on class logits [n, K] and target classes [n] (a kind with a
    digit term)."""
    term = cfg.kind_spec.digit_term
    if term is None:
        raise ValueError(f"loss kind {cfg.kind!r} has no digit term")
    return term(class_logits, target, cfg)
