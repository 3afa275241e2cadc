"""The one typed record of every loss option (spec: ../spec/del-loss.md; docs/losses.md).

Defaults reproduce the DEL authors' code. Fields left ``None`` resolve per ``kind``
(``alpha``, ``place_weighting``); read the resolved values through the properties.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossKind = Literal["mle", "del", "del_distance", "ntl_was", "ntl_mse", "dist2", "mixce", "emo"]

# Kinds whose numeric part is computed from the digit-class logits at digit positions.
DIGIT_KINDS: frozenset[str] = frozenset({"del", "del_distance", "ntl_was", "ntl_mse", "dist2"})

# Coefficient of the numeric part when `alpha` is not given: the DEL authors' 0.1, the NTL
# paper's 0.3, the DIST2 paper's 0.1.
DEFAULT_ALPHA: dict[str, float] = {
    "del": 0.1,
    "del_distance": 0.1,
    "ntl_was": 0.3,
    "ntl_mse": 0.3,
    "dist2": 0.1,
}


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
    """Tokens per chunk of the fused path; 0 chooses by device (models/device.py)."""

    @model_validator(mode="after")
    def _check_cross_fields(self) -> NumericLossConfig:
        if self.include_decimal_point and self.kind != "del":
            raise ValueError(
                f"include_decimal_point=True needs kind='del' (kind={self.kind!r} measures "
                "distances between digit values and '.' has none); set include_decimal_point=false"
            )
        if self.place_weighting and self.kind not in DIGIT_KINDS:
            raise ValueError(
                f"place_weighting=True has no effect for kind={self.kind!r}: it weighs digit "
                f"positions of {sorted(DIGIT_KINDS)}; leave place_weighting unset"
            )
        return self

    @property
    def resolved_alpha(self) -> float:
        """The coefficient actually applied to the numeric part (0 for kinds without one)."""
        if self.kind not in DIGIT_KINDS:
            return 0.0
        return DEFAULT_ALPHA[self.kind] if self.alpha is None else self.alpha

    @property
    def resolved_place_weighting(self) -> bool:
        if self.place_weighting is None:
            return self.kind in ("del", "del_distance")
        return self.place_weighting

    @property
    def num_classes(self) -> int:
        """K: ten digits, plus '.' when it is a class."""
        return 11 if self.include_decimal_point else 10
