"""The numeric loss in Megatron-LM's own training loop (`pretrain_gpt.py` on `megatron.training`).

A Megatron-LM run keeps its model builder, its batches and its loop; three pieces change
(README, "In Megatron-LM"):

* the model: `numeric_builder(gpt_builder, digit_vocab, loss_config)` in place of
  `gpt_builder` in `partial(model_provider, gpt_builder)` (megatron-core 0.16's
  pretrain_gpt.py), or `numeric_loss_hook(digit_vocab, loss_config)` appended to the model
  config's `pre_wrap_hooks` (the config-container form, `megatron.training` 0.17 and later).
  Either turns the GPTModel that Megatron-LM's own builder made (every architecture field it
  reads: tied embeddings, rope base and scaling, QKV bias, ...) into a `NumericLossGPTModel`
  (`NumericLossGPTModel.from_gpt_model`), and refuses the settings under which megatron's
  schedules cannot sum it exactly (`check_megatron_loop`);
* the forward step: `forward_step(pretrain_gpt.forward_step)`, Megatron-LM's own (its
  `get_batch`, `loss_mask` and `packed_seq_params` passed to the model), handing back this
  module's `loss_func` instead of its own;
* the loss function: `loss_func(loss_mask, output_tensor, model=None)`, Megatron's return
  contract (loss sum, token count, report of [sum, count] pairs) with its NaN, Inf and
  spiky-loss checks through the rerun state machine.

Nothing of `megatron.training` is imported here but `get_args`, at call time inside its loop
(0.16's wheel has no `megatron.training`; the package imports without it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from ..errors import UserError
from ..losses import DigitVocab, NumericLossConfig
from ..losses.documents import Shifted
from . import gpt

# Megatron-LM's factor for a spiky loss (pretrain_gpt.py SPIKY_LOSS_FACTOR): 10x the largest
# loss seen so far
SPIKY_LOSS_FACTOR = 10.0


def check_megatron_loop(config: Any, loss_config: NumericLossConfig) -> None:
    """Refuse (one line each) the settings under which megatron-core's schedules cannot give
    the numeric loss of the global batch.

    config: the model's TransformerConfig (what the schedules read). Megatron divides each
    micro-batch's loss sum by its own token count unless `calculate_per_token_loss` is set
    (then it divides the sum over micro-batches and data-parallel ranks by their token
    count, in `finalize_model_grads`): only the latter is the loss of the global batch.
    `normalize="digits"` divides each micro-batch's numeric part by its own digit count,
    which no sum over micro-batches undoes. Context parallelism splits a sequence across
    ranks, and with it the numbers whose digit places the loss reads."""
    if not config.calculate_per_token_loss:
        raise UserError(
            "the numeric loss needs megatron's per-token loss: set --calculate-per-token-loss "
            "(Megatron-LM) or model.calculate_per_token_loss=True with "
            "ddp.average_in_collective=False (Megatron-Bridge); megatron otherwise divides "
            "each micro-batch by its own token count"
        )
    if loss_config.normalize != "tokens":
        raise UserError(
            f"normalize={loss_config.normalize!r} divides each micro-batch's numeric part by "
            "its own digit count, which megatron's sum over micro-batches cannot undo: use "
            "NumericLossConfig(normalize='tokens') in megatron's loops"
        )
    if config.cross_entropy_loss_fusion:
        # megatron's fused cross entropy (native or TE) replaces its own loss, which the head
        # replaces: the flag would be read and do nothing
        raise UserError(
            "cross_entropy_loss_fusion (--cross-entropy-loss-fusion, --cross-entropy-fusion-"
            "impl) fuses megatron's own cross entropy, which the numeric loss head replaces: "
            "leave it off (the head has its own fused path, loss.fused_output)"
        )
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        # its schedule builds a plan (model.build_schedule_plan) whose last node computes
        # megatron's own loss, not the head's
        raise UserError(
            "overlap_moe_expert_parallel_comm (--overlap-moe-expert-parallel-comm) schedules "
            "megatron's own loss inside its plan, not the numeric loss head: leave it off"
        )
    # muP: exact where the head runs in GPTModel's output_processor, after megatron's logit
    # scaling (0.18+); refused where it has none (0.17)
    gpt.refuse_mup_without_output_processor(config)
    if config.context_parallel_size > 1:
        raise UserError(
            f"context_parallel_size={config.context_parallel_size}: the numeric loss reads "
            "each number's digit places along the whole sequence, which context parallelism "
            "splits across ranks; use context_parallel_size=1"
        )


def to_numeric_model(
    model: GPTModel,
    digit_vocab: DigitVocab,
    loss_config: NumericLossConfig,
    packed_labels: Shifted = "row",
) -> gpt.NumericLossGPTModel:
    """A GPTModel (one pipeline stage) built by megatron's own builder, made to end in the
    numeric loss head, after `check_megatron_loop`. packed_labels: where the loop puts the
    labels of packed documents, "row" for Megatron-LM's data sets (the packed row shifted
    as a whole), "document" for Megatron-Bridge's (`losses.documents`)."""
    check_megatron_loop(model.config, loss_config)
    if model.fp16_lm_cross_entropy:
        # GPTModel's own cross entropy in half precision; the head computes in float32
        raise UserError(
            "fp16_lm_cross_entropy (--fp16-lm-cross-entropy) asks for megatron's own cross "
            "entropy in half precision; the numeric loss head computes its loss in float32: "
            "leave it off"
        )
    return gpt.NumericLossGPTModel.from_gpt_model(
        model, digit_vocab, loss_config, packed_labels=packed_labels
    )


def numeric_builder(
    builder: Callable[..., GPTModel], digit_vocab: DigitVocab, loss_config: NumericLossConfig
) -> Callable[..., gpt.NumericLossGPTModel]:
    """A model builder of Megatron-LM's signature (its `gpt_builders.gpt_builder`: `args,
    pre_process, post_process, vp_stage=None, config=None, pg_collection=None`) that calls
    `builder` and returns its model ending in the numeric loss head. For
    `partial(model_provider, numeric_builder(gpt_builder, ...))`."""

    def numeric_gpt_builder(
        args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None
    ):
        model = builder(
            args, pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection
        )
        return to_numeric_model(model, digit_vocab, loss_config)

    return numeric_gpt_builder


def numeric_loss_hook(
    digit_vocab: DigitVocab, loss_config: NumericLossConfig
) -> Callable[[list[GPTModel]], list[gpt.NumericLossGPTModel]]:
    """A pre-wrap hook (the model stages a builder made, before megatron wraps them for
    mixed precision and data parallelism) that makes each stage end in the numeric loss head:
    for `model_config.pre_wrap_hooks` of `megatron.training`'s config container (0.17+)."""

    def numeric_loss_stages(models: list[GPTModel]) -> list[gpt.NumericLossGPTModel]:
        return [to_numeric_model(model, digit_vocab, loss_config) for model in models]

    return numeric_loss_stages


def forward_step(megatron_forward_step: Callable) -> Callable:
    """Megatron-LM's forward step (pretrain_gpt.py's `forward_step(data_iterator, model,
    return_schedule_plan=False)`: its get_batch, the model called with `loss_mask` and
    `packed_seq_params`) returning this module's `loss_func` instead of its own, with the
    checks Megatron-LM's arguments ask for (--check-for-nan-in-loss-and-grad,
    --check-for-spiky-loss)."""

    def numeric_forward_step(data_iterator, model, return_schedule_plan: bool = False):
        from megatron.training import get_args

        args = get_args()
        refuse_schedule_plan(return_schedule_plan)
        _refuse_distillation(args)
        output, theirs = megatron_forward_step(data_iterator, model, return_schedule_plan)
        checks = {
            "check_for_nan_in_loss": getattr(args, "check_for_nan_in_loss_and_grad", True),
            "check_for_spiky_loss": getattr(args, "check_for_spiky_loss", False),
        }
        return output, partial(loss_func, _loss_mask_of(theirs), model=model, **checks)

    return numeric_forward_step


def refuse_schedule_plan(return_schedule_plan: bool) -> None:
    """MoE's overlapped all-to-all schedule asks the forward step for a schedule plan
    (`model.build_schedule_plan`), whose post-process node computes megatron's own loss."""
    if return_schedule_plan:
        raise UserError(
            "return_schedule_plan=True (--overlap-moe-expert-parallel-comm): megatron's "
            "schedule plan computes its own loss, not the numeric loss head's; leave "
            "overlap_moe_expert_parallel_comm off"
        )


def _refuse_distillation(args: Any) -> None:
    """Megatron-LM's pretrain_gpt.loss_func takes other branches for offline knowledge
    distillation (--logits-load-dir: cached teacher logits, main) and ModelOpt distillation
    (--export-kd-teacher-load); this module's loss function replaces it and has neither."""
    for name, flag in (
        ("logits_load_dir", "--logits-load-dir"),
        ("export_kd_teacher_load", "--export-kd-teacher-load"),
    ):
        if getattr(args, name, None):
            raise UserError(
                f"{flag} asks pretrain_gpt.loss_func for knowledge distillation, which the "
                "numeric loss function replaces: distillation with the numeric loss is not "
                f"supported; drop {flag}"
            )


def _loss_mask_of(loss_function: Any) -> torch.Tensor:
    """The loss mask Megatron-LM's forward step bound into its `partial(loss_func,
    loss_mask, model=model)` (both 0.16's pretrain_gpt.py and today's)."""
    if not (isinstance(loss_function, partial) and loss_function.args):
        raise TypeError(
            "forward_step wraps Megatron-LM's pretrain_gpt.forward_step, which returns "
            f"(output, partial(loss_func, loss_mask, model=model)); got {loss_function!r}"
        )
    return loss_function.args[0]


def loss_func(
    loss_mask: torch.Tensor,
    output_tensor: Any,
    model: Any = None,
    *,
    check_for_nan_in_loss: bool = True,
    check_for_spiky_loss: bool = False,
    spiky_loss_factor: float = SPIKY_LOSS_FACTOR,
):
    """Megatron's loss function: (loss sum, token count, report of [sum, count] pairs).

    output_tensor: what NumericLossGPTModel returns with labels (or the plain tuple
    megatron's Float16Module makes of it); loss_mask [b, s]; model: unused (Megatron-LM
    passes it for ModelOpt's distillation). The loss sum is checked as Megatron-LM's own
    loss function checks it (NaN and Inf fatal, a spiky loss reported) through megatron's
    rerun state machine. Report (`megatron_report`): 'lm loss' is the cross entropy, so that
    its PPL is the perplexity; 'objective' the loss trained on.
    """
    loss, num_tokens, report = gpt.loss_func(loss_mask, output_tensor)
    _validate(loss, check_for_nan_in_loss, check_for_spiky_loss, spiky_loss_factor)
    return loss, num_tokens, megatron_report(report)


def megatron_report(report: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`gpt.loss_func`'s report in the form Megatron's loops log.

    Megatron sums each [sum, count] pair over micro-batches and data-parallel ranks, logs
    sum / count under its key, and prints exp() of every key at validation as its 'PPL':
    'lm loss' carries the cross entropy (its PPL is the perplexity, comparable with any
    other run), 'objective' the loss trained on (CE + α·numeric; MixCE's and EMO's own);
    'numeric' and the digit metrics follow. Every count carries float32's smallest normal
    number, which vanishes in any count of at least one (c + tiny == c exactly) and makes a
    global batch without a digit read 0 instead of nan (0 / 0), for digit_acc and its kin.
    """
    named = {"lm loss": report["ce"], "objective": report["lm loss"]}
    named.update((k, v) for k, v in report.items() if k not in ("ce", "lm loss"))
    return {k: _never_nan(pair) for k, pair in named.items()}


def _never_nan(pair: torch.Tensor) -> torch.Tensor:
    tiny = torch.finfo(pair.dtype).tiny
    return torch.stack([pair[0], pair[1] + tiny])


def _validate(loss: torch.Tensor, nan: bool, spiky: bool, factor: float) -> None:
    """Megatron-LM's checks of a micro-batch's loss before the data-parallel all-reduce, with
    its messages (a job's log watchers match them)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    if nan:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward pass is deterministic
                fatal=True,
            )
    if spiky:
        machine.validate_result(
            result=loss,
            rejection_func=partial(machine.is_unexpectedly_large, threshold=factor, context="loss"),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
