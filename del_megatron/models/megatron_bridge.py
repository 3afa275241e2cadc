"""The numeric loss in Megatron-Bridge's training loop (`megatron.bridge.training.pretrain`).

DEL is one line of a recipe, and the forward step its `pretrain` call names (README, "In
Megatron-Bridge"):

    cfg.model = NumericLossGPTModelProvider.from_provider(cfg.model, digit_vocab, loss_config)
    pretrain(cfg, forward_step_func=forward_step)

with `cfg.model.calculate_per_token_loss = True` and `cfg.ddp.average_in_collective = False`
(megatron's schedules then sum the global batch exactly: `megatron_lm.check_megatron_loop`).

* `NumericLossGPTModelProvider`: Bridge's GPTModelProvider (every field of the recipe's or
  AutoBridge's provider kept) whose `provide(pre_process, post_process, vp_stage)` returns the
  GPTModel Bridge builds, ending in the numeric loss head. EMO's cost embedding is taken from
  the weights AutoBridge's pre-wrap hook loads (`gpt.take_emo_cost_embedding`, the hook after
  it), kept float32 under Bridge's Float16Module, saved in Bridge's checkpoints, and in no
  HF import or export (it is no weight of the model).
* `forward_step(state, data_iterator, model, return_schedule_plan=False)`: Bridge's own forward
  step (its get_batch, packed sequences, FLOPs accounting, timers), with the loss mask reaching
  the model, and this project's loss function (`megatron_lm.loss_func`: Megatron's contract and
  checks) instead of `masked_next_token_loss`, which cannot read the head's output (it raises:
  `NumericStats.view`). Bridge's forward step does not pass `loss_mask` to the model; here the
  labels it hands the model carry `ignore_index` at masked positions instead, which the head
  reads as masked (the same positions, the same statistics), within
  `gpt.labels_carry_the_mask()` (elsewhere labels without a mask are refused). Refused in
  one line: `return_schedule_plan=True` and Bridge's `DistillationProvider`; the spiky-loss
  check uses `rerun_state_machine.spiky_loss_factor`.

Import this module only where Megatron-Bridge is installed (Python 3.12, megatron-core 0.17+);
the package never imports it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.training import gpt_step

from ..errors import UserError
from ..losses import DigitVocab, NumericLossConfig
from . import megatron_lm
from .gpt import NumericLossGPTModel, labels_carry_the_mask, take_emo_cost_embedding


@dataclass
class NumericLossGPTModelProvider(GPTModelProvider):
    """A GPTModelProvider whose models end in the numeric loss head of `numeric_loss` on the
    digits of `digit_vocab`."""

    digit_vocab: DigitVocab | None = None
    numeric_loss: NumericLossConfig = field(
        default_factory=lambda: NumericLossConfig(normalize="tokens")
    )

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> NumericLossGPTModel:
        """Bridge's GPTModel of this configuration (one pipeline stage), ending in the head."""
        if self.digit_vocab is None:
            raise UserError(
                "NumericLossGPTModelProvider needs digit_vocab= (e.g. DigitVocab.from_hf of the "
                "run's tokenizer)"
            )
        model = super().provide(pre_process, post_process, vp_stage)
        # Bridge's packed data sets shift each document on its own
        labels = "document"
        return megatron_lm.to_numeric_model(
            model, self.digit_vocab, self.numeric_loss, packed_labels=labels
        )

    @classmethod
    def from_provider(
        cls,
        provider: GPTModelProvider,
        digit_vocab: DigitVocab,
        numeric_loss: NumericLossConfig,
    ) -> NumericLossGPTModelProvider:
        """The provider of a recipe or of `AutoBridge.to_megatron_provider()` with every field
        it holds, providing models that end in the numeric loss head. A provider class that
        builds its model its own way (its own `provide`) or holds fields of its own is refused,
        naming it: its model is not the GPTModel this head replaces the loss of."""
        kind = type(provider)
        own = {f.name for f in fields(kind)} - {f.name for f in fields(GPTModelProvider)}
        if kind.provide is not GPTModelProvider.provide or own:
            how = f"fields {', '.join(sorted(own))}" if own else "its own provide()"
            raise UserError(
                f"{kind.__name__} builds its model its own way ({how}): "
                "NumericLossGPTModelProvider extends GPTModelProvider's GPTModel only"
            )
        values = {f.name: getattr(provider, f.name) for f in fields(GPTModelProvider) if f.init}
        # GPTModelProvider turns megatron's fused cross entropy on by default, for megatron's
        # own loss, which the head replaces: off here, refused if set on the numeric provider
        # (megatron_lm.check_megatron_loop)
        values["cross_entropy_loss_fusion"] = False
        numeric = cls(**values, digit_vocab=digit_vocab, numeric_loss=numeric_loss)
        # and the hooks registered on it, which are no fields: AutoBridge's
        # to_megatron_provider() loads the Hugging Face weights in a pre-wrap hook (with
        # perform_initialization=False; without the hook the model would train from
        # uninitialized memory)
        if provider.pre_wrap_hook is not None:  # the registered hooks, composed in order
            numeric.register_pre_wrap_hook(provider.pre_wrap_hook)
        # EMO's cost embedding from the weights those hooks loaded (before: taken at the
        # build, from uninitialized memory); ahead of hooks registered later (Bridge's PEFT
        # hook wraps the output layer)
        numeric.register_pre_wrap_hook(take_emo_cost_embedding)
        if provider.post_wrap_hook is not None:
            numeric.register_post_wrap_hook(provider.post_wrap_hook)
        return numeric


def forward_step(state, data_iterator, model, return_schedule_plan: bool = False):
    """Megatron-Bridge's forward step (`gpt_step.forward_step`'s work, Bridge's GlobalState
    first) returning (output, loss function) with this project's loss function."""
    common = gpt_step._forward_step_common
    if "_get_batch_fn" not in inspect.signature(common).parameters:
        raise RuntimeError(
            "this Megatron-Bridge's gpt_step._forward_step_common takes no _get_batch_fn "
            "(tested: megatron-bridge 0.6.2)"
        )
    from megatron.bridge.models.distillation_provider import DistillationProvider
    from megatron.core.utils import get_attr_wrapped_model

    megatron_lm.refuse_schedule_plan(return_schedule_plan)
    if isinstance(state.cfg.model, DistillationProvider):
        # Bridge distils with its own forward step (forward_step_modelopt, loss_func_kd)
        raise UserError(
            f"{type(state.cfg.model).__name__} is Bridge's knowledge distillation, whose loss "
            "the numeric loss function replaces: distillation with the numeric loss is not "
            "supported"
        )
    head = get_attr_wrapped_model(model, "head")  # None on a stage without the output layer
    get_batch = partial(_batch_with_mask_in_labels, head.cfg.ignore_index if head else None)
    with labels_carry_the_mask():  # Bridge calls the model without loss_mask
        output, loss_mask = common(
            state, data_iterator, model, return_schedule_plan, _get_batch_fn=get_batch
        )
    checks = state.cfg.rerun_state_machine
    loss_function = partial(
        megatron_lm.loss_func,
        loss_mask,
        check_for_nan_in_loss=checks.check_for_nan_in_loss,
        check_for_spiky_loss=checks.check_for_spiky_loss,
        spiky_loss_factor=checks.spiky_loss_factor,
    )
    return output, loss_function


def _batch_with_mask_in_labels(ignore_index: int | None, *args: Any, **kwargs: Any):
    """Bridge's `get_batch`, with `ignore_index` in the labels where the loss mask is 0 (Bridge
    calls the model with the labels but not the mask)."""
    tokens, labels, loss_mask, attention_mask, position_ids, packed = gpt_step.get_batch(
        *args, **kwargs
    )
    # a stage without the head (ignore_index None) may still be given the full batch
    # (Bridge's get_batch, for packed data or attention masks on middle stages and virtual
    # chunks): its labels are not read there
    if ignore_index is not None and labels is not None and loss_mask is not None:
        labels = labels.masked_fill(loss_mask == 0, ignore_index)
    return tokens, labels, loss_mask, attention_mask, position_ids, packed
