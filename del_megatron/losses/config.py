"""The one typed record of every loss option (spec: ../spec/del-loss.md; docs/losses.md).

Defaults reproduce the DEL authors' code. Fields left ``None`` resolve per ``kind``
(``alpha``, ``place_weighting``); read the resolved values through the properties.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .kinds import KINDS, Kind, LossKind

# Kinds whose numeric part is computed from the digit-class logits at digit positions.
DIGIT_KINDS: frozenset[str] = frozenset(k for k, v in KINDS.items() if v.digit_term is not None)

# Coefficient of the numeric part when `alpha` is not given (kinds.KINDS).
DEFAULT_ALPHA: dict[str, float] = {k: KINDS[k].default_alpha for k in sorted(DIGIT_KINDS)}


class NumericLossConfig(BaseModel):
    """Options of the numeric losses; keyword-only, frozen, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: LossKind = "del"
    """Which objective: `mle` (CE only), `del`, `del_distance`, `ntl_was`, `ntl_mse`,
    `dist2`, `mixce`, `emo`."""

    alpha: float | None = Field(default=None, ge=0.0)
    """Coefficient of the numeric part; None takes the kind's default (DEFAULT_ALPHA).
    Ignored by kinds without a numeric part (mle, mixce, emo)."""

    normalize: Literal["digits", "tokens"] = "digits"
    """`digits`: numeric part is a mean over digit positions (the authors'); `tokens`: each
    digit position adds alpha*u*l to its own token and everything is divided by the number of
    unmasked tokens (composes with Megatron's per-token loss sums)."""

    place_weighting: bool | None = None
    """Weigh each digit position by u(place); None: on for del/del_distance, off otherwise."""

    place_slope: float = Field(default=2.0, gt=0.0)
    """s in u(i) = s*(i+1) for integer places i >= 0."""

    decimal_base: float = Field(default=1.02, gt=0.0)
    """b in u(i) = b**(i-1) for decimal places i < 0."""

    include_decimal_point: bool = False
    """Add '.' (a decimal point inside a number) as an eleventh class (del only)."""

    detach_criterion: bool = False
    """Stop the gradient through the digit conditional probability p-hat (del, del_distance)."""

    shift_invariant: bool = False
    """Ours, an ablation arm, not the authors' DEL (del, del_distance): the BCE reads the
    centred class logits z_k - mean_j z_j, so the term is unchanged when every logit moves by
    the same amount (which softmax ignores). The default (false) is the authors' BCE on raw
    class logits, which a model can lower by shifting its logits down without changing any
    probability (docs/losses.md, "the logit-shift escape")."""

    dist2_tau: float = Field(default=1.0, gt=0.0)
    """Temperature tau of the DIST2 target q(v) ~ exp(-(v-y)^2 / tau)."""

    mixce_eta: float = Field(default=0.5, ge=0.0, le=1.0)
    """Mixing weight eta of MixCE: eta*CE + (1-eta)*sg(q)*CE."""

    ignore_index: int = -100
    """Label value that marks a position without a target."""

    fused_output: bool = False
    """In a model: compute the output layer and the loss together in token chunks
    (`vocab_parallel_fused_numeric_loss`), never holding the [tokens, V/tp] logits; same
    values and gradients as the unfused path."""

    fused_chunk_tokens: int = Field(default=0, ge=0)
    """Tokens per chunk of the fused path; 0 takes the device's default
    (`losses/fused.py`, `default_chunk_tokens`)."""

    fused_recompute: bool = False
    """Fused path only: form no gradient in forward and make each chunk's logits again in
    backward (a fourth product, about 4/3 of the time). Saves the float32 [V/tp, h] weight
    gradient held from forward to backward, which matters where `.grad` is kept between
    micro-batches (ZeRO 1 with gradient accumulation; docs/benchmarks.md)."""

    @model_validator(mode="after")
    def _check_cross_fields(self) -> NumericLossConfig:
        if self.include_decimal_point and not self.kind_spec.decimal_point_class:
            raise ValueError(
                f"include_decimal_point=True needs kind='del' (kind={self.kind!r} measures "
                "distances between digit values and '.' has none); set include_decimal_point=false"
            )
        if self.place_weighting and self.kind_spec.digit_term is None:
            raise ValueError(
                f"place_weighting=True has no effect for kind={self.kind!r}: it weighs digit "
                f"positions of {sorted(DIGIT_KINDS)}; leave place_weighting unset"
            )
        if self.shift_invariant and not self.kind_spec.bce_on_logits:
            raise ValueError(
                f"shift_invariant=True changes the BCE of kind='del' and 'del_distance'; "
                f"kind={self.kind!r} reads only the digit distribution, which a common shift "
                "leaves unchanged already: leave shift_invariant unset"
            )
        if self.fused_recompute and not self.fused_output:
            raise ValueError(
                "fused_recompute=True applies to the fused path only; set fused_output=true "
                "or leave fused_recompute unset"
            )
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        # Megatron-Bridge's HF export walks the model's config (the provider holding this
        # record) with `remove_non_pickleables`, which sets every attribute of a copy of each
        # object it meets to its own value: such an assignment changes nothing and passes;
        # any other is refused (frozen)
        if name in type(self).model_fields and getattr(self, name) is value:
            return
        super().__setattr__(name, value)

    @property
    def kind_spec(self) -> Kind:
        """What `kind` is made of (kinds.KINDS)."""
        return KINDS[self.kind]

    @property
    def resolved_alpha(self) -> float:
        """The coefficient actually applied to the numeric part (0 for kinds without one)."""
        if self.kind_spec.digit_term is None:
            return 0.0
        return self.kind_spec.default_alpha if self.alpha is None else self.alpha

    @property
    def resolved_place_weighting(self) -> bool:
        if self.place_weighting is None:
            return self.kind_spec.place_weighting
        return self.place_weighting

    @property
    def num_classes(self) -> int:
        """K: ten digits, plus '.' when it is a class."""
        return 11 if self.include_decimal_point else 10
