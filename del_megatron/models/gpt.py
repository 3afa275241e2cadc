"""The megatron-core adapter: a GPTModel whose loss is `NumericLossHead`, and a `loss_func`
following megatron-core's contract for `get_forward_backward_func`."""

from __future__ import annotations

import contextlib
import contextvars

import torch
from megatron.core.models.gpt import GPTModel

from ..errors import UserError
from ..losses import REPORT_PAIRS, DigitVocab, NumericLossConfig, NumericLossHead, report_pairs
from ..losses.assemble import NumericLossOutput, NumericStats
from ..losses.diagnostics import GRAD_PROBE_PAIRS, output_gradient_probe, probe_pairs

# True while a forward step whose loop calls the model with labels but no loss_mask has put
# ignore_index in the labels at the masked positions instead (Megatron-Bridge's: its
# _forward_step_common never passes the mask; megatron_bridge.forward_step sets this)
_LABELS_CARRY_THE_MASK = contextvars.ContextVar("labels_carry_the_mask", default=False)


@contextlib.contextmanager
def labels_carry_the_mask():
    """Within it, NumericLossGPTModel takes labels without `loss_mask=`: the caller has put
    the head's ignore_index at every masked position (the same positions, the same loss)."""
    token = _LABELS_CARRY_THE_MASK.set(True)
    try:
        yield
    finally:
        _LABELS_CARRY_THE_MASK.reset(token)


def _required_loss_mask(loss_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The loss mask the model was called with; none is refused (outside
    `labels_carry_the_mask`): without it the head would count every position, padding and
    prompts included (logged lm loss 4.87201 against 4.87531, issue 51)."""
    if loss_mask is None and not _LABELS_CARRY_THE_MASK.get():
        raise UserError(
            "NumericLossGPTModel was called with labels but no loss_mask: the forward step "
            "must call model(..., labels=labels, loss_mask=loss_mask) (Megatron-LM's "
            "pretrain_gpt.forward_step does; in Megatron-Bridge use "
            "del_megatron.models.megatron_bridge.forward_step)"
        )
    return loss_mask


def _refuse_packed(packed_seq_params) -> None:
    """Packed documents refused before the forward: the head reads digit runs along each row,
    so two packed documents that meet digit-to-digit would be one number (numeric term 0.3326
    against 0.2340 as separate rows, issue 51)."""
    if packed_seq_params is not None:
        raise UserError(
            "packed documents (packed_seq_params): the numeric loss does not yet end digit "
            "runs at document boundaries; train on unpacked rows (an EOD token between "
            "documents)"
        )


class NumericLossGPTModel(GPTModel):
    """GPTModel whose loss is the numeric loss head (`self.head`).

    Called with labels and `loss_mask=` (labels, loss_mask [b, s]), forward returns the head's
    `NumericLossOutput`: per-token losses [b, s] and statistics; `loss_func` turns it into
    megatron's (loss sum, token count, report). Labels without `loss_mask=` are refused
    (outside `labels_carry_the_mask`). Without labels it returns megatron's logits
    [b, s, V/tp]. EMO's cost embedding is the head's buffer `head.emo_cost_embedding`.
    promise_scaled_loss: backward will be of `loss_func`'s loss sum times one factor (the
    trainer's); the head's fused op then makes no host read (`NumericLossHead`).
    """

    def __init__(
        self,
        *args,
        digit_vocab: DigitVocab,
        loss_config: NumericLossConfig,
        promise_scaled_loss: bool = False,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.head = self._numeric_head(digit_vocab, loss_config, promise_scaled_loss)
        self.register_load_state_dict_pre_hook(emo_buffer_saved_before_the_head)

    @classmethod
    def from_gpt_model(
        cls,
        model: GPTModel,
        digit_vocab: DigitVocab,
        loss_config: NumericLossConfig,
        promise_scaled_loss: bool = False,
    ) -> NumericLossGPTModel:
        """`model`, built by another loop's own builder (Megatron-LM's, Megatron-Bridge's
        provider), made this class in place: the same module, parameters and architecture
        (every field that builder read), ending in the loss head. Its class becomes this one
        and it gains the head, nothing else."""
        if type(model) is not GPTModel:
            raise TypeError(
                f"the numeric loss head replaces megatron-core GPTModel's loss; got "
                f"{type(model).__name__} (a model class of its own may compute its loss itself)"
            )
        model.__class__ = cls
        try:
            model.head = model._numeric_head(digit_vocab, loss_config, promise_scaled_loss)
        except BaseException:
            model.__class__ = GPTModel  # a refused model is left as it was
            raise
        model.register_load_state_dict_pre_hook(emo_buffer_saved_before_the_head)
        return model

    def _numeric_head(
        self, digit_vocab: DigitVocab, loss_config: NumericLossConfig, promise_scaled_loss: bool
    ) -> NumericLossHead | None:
        """The loss head of this model, built, on the stage holding the output layer only
        (`post_process`): a pipeline's other stages have no loss and no output weights to take
        EMO's cost embedding from (None there)."""
        if self.config.mtp_num_layers is not None:
            raise ValueError("multi-token prediction is not supported with the numeric loss head")
        if not self.parallel_output:
            raise ValueError(
                "the numeric loss head works on vocabulary shards: build the model with "
                "parallel_output=True (megatron's default)"
            )
        if not self.post_process:
            return None
        # the cost embedding (emo) is taken from the weights at construction; see
        # freeze_emo_cost_embedding for weights loaded afterwards
        return NumericLossHead(
            digit_vocab, loss_config, self.output_weight(), promise_scaled_loss=promise_scaled_loss
        )

    def output_weight(self) -> torch.Tensor:
        """This rank's output-layer rows [V/tp, h] (the embedding's when they are tied)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def freeze_emo_cost_embedding(self) -> None:
        """Take EMO's cost embedding again from the current output weights (this rank's
        rows): call it after loading initial weights into a built model (the trainer does).
        Without it, the weights at construction are the ones it is taken from. Nothing to
        take on a pipeline stage without the output layer."""
        if self.head is not None:
            self.head.take_cost_embedding(self.output_weight())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron's sharded state dict (distributed checkpoints), with EMO's cost embedding
        declared as what it is: this rank's rows [V/tp, h] of a [V, h] tensor, sharded over
        tensor-parallel ranks along dim 0 like the output weight it is taken from (megatron's
        default for a buffer of a plain module is a tensor replicated over them, which keeps
        one rank's rows only)."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.head is not None and self.head.emo_cost_embedding is not None:
            name = "emo_cost_embedding"
            sharded.update(
                make_sharded_tensors_for_checkpoint(
                    {name: self.head.emo_cost_embedding},
                    f"{prefix}head.",
                    {name: 0},
                    sharded_offsets,
                    tp_group=self.pg_collection.tp,
                    dp_cp_group=metadata["dp_cp_group"],
                )
            )
        return sharded

    def forward(self, *args, numeric_grad_probe: bool = False, **kwargs):
        """megatron-core's forward; `numeric_grad_probe=True` (with `labels=` and
        `loss_mask=` as keywords) also measures the numeric term's share of the gradient at
        the output layer's logits (`losses.diagnostics`), added to the statistics as the
        probe's [sum, count] keys. An argument of the call, not state of the model: the
        trainer passes it on one micro-batch of a log step. Nothing is probed where there is
        nothing to probe: a kind without a digit term, a stage without the output layer, or
        the fused head (`loss.fused_output`), whose logits never exist as a tensor. Packed
        documents (`packed_seq_params`) with labels are refused (`_refuse_packed`)."""
        if self.post_process and kwargs.get("labels") is not None:
            _refuse_packed(kwargs.get("packed_seq_params"))
        if not numeric_grad_probe or not self._probed():
            return super().forward(*args, **kwargs)
        labels, loss_mask = kwargs.pop("labels", None), kwargs.pop("loss_mask", None)
        if labels is None or len(args) > 4:
            raise ValueError("numeric_grad_probe needs labels= (and loss_mask=) as keywords")
        loss_mask = _required_loss_mask(loss_mask)
        # megatron's own path without labels gives this rank's logits, [b, s, V/tp]
        logits = super().forward(*args, labels=None, **kwargs).transpose(0, 1)  # [s, b, V/tp]
        group = self.pg_collection.tp
        output = self.head(labels, loss_mask, group, logits=logits)

        def loss_of(copy: torch.Tensor) -> NumericLossOutput:
            # the head's op called as a function: the head module itself runs once a forward,
            # as DeepSpeed's ZeRO 3 traces each module's calls
            return self.head.forward(labels, loss_mask, group, logits=copy)

        probe = output_gradient_probe(loss_of, logits, self.head.cfg.resolved_alpha, group)
        return output._replace(stats=NumericStats({**output.stats, **probe}))

    def _probed(self) -> bool:
        head = self.head if self.post_process else None
        return head is not None and not head.fused and head.cfg.kind_spec.digit_term is not None

    def _before_reading_output_weight(self, hidden_states) -> None:
        """The fused head reads the output layer's weight without calling the layer: run the
        layer's forward pre-hooks first, as calling it would. Hook-driven gathering waits
        there: megatron's DistributedDataParallel with overlap_param_gather finishes the
        weight's bucket all-gather in such a hook (`finish_param_sync`); read before it, the
        weight is mid-gather and the next step asserts on the bucket's pending handle. Not
        under DeepSpeed's ZeRO 3 (a partitioned weight has `ds_id`), whose hooks gather and
        release a module around its own forward and which gathers this weight as one read
        inside the engine's forward (docs/architecture.md, "Decisions"). A tied weight on the
        first stage belongs to the embedding, whose forward ran in this same forward."""
        if self.share_embeddings_and_output_weights and self.pre_process:
            return
        layer = self.output_layer
        if hasattr(layer.weight, "ds_id"):
            return
        for key, hook in layer._forward_pre_hooks.items():
            if key in layer._forward_pre_hooks_with_kwargs:
                hook(layer, (hidden_states,), {})
            else:
                hook(layer, (hidden_states,))

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """With labels: the loss head, on the hidden states [s, b, h] and the output weight
        when the head is fused (the output layer and the loss in token chunks), else on the
        output layer's logits [s, b, V/tp]. Without labels: megatron-core's own."""
        if labels is None or not self.post_process:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, *args, **kwargs
            )
        loss_mask = _required_loss_mask(kwargs.get("loss_mask"))
        group = self.pg_collection.tp
        weight = self.output_weight()
        if self.head.fused and not self.config.sequence_parallel:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            # as in megatron's output layer: identity forward, all-reduce of the input
            # gradient (each rank's is a partial sum over its vocabulary shard) in backward
            hidden = copy_to_tensor_model_parallel_region(hidden_states, group=group)
            self._before_reading_output_weight(hidden_states)
            return self.head(labels, loss_mask, group, hidden=hidden, output_weight=weight)
        logits, _ = self.output_layer(
            hidden_states, weight=weight if self.share_embeddings_and_output_weights else None
        )
        return self.head(labels, loss_mask, group, logits=logits)


def emo_buffer_saved_before_the_head(module, state_dict, prefix, *args) -> None:
    """Checkpoints saved before the loss head (2026-12-01) kept EMO's cost embedding as the
    model's own buffer `emo_cost_embedding`: read it as the head's."""
    old = prefix + "emo_cost_embedding"
    if old in state_dict:
        state_dict[prefix + "head.emo_cost_embedding"] = state_dict.pop(old)


def loss_func(loss_mask: torch.Tensor, output: NumericLossOutput | tuple):
    """megatron-core loss function: (loss sum, token count, report dict of [sum, count]).

    output: what NumericLossGPTModel returns with labels (per-token losses [b, s] and their
    statistics), or the plain tuple megatron's Float16Module (bf16 / fp16 runs) makes of it;
    loss_mask [b, s]. Report keys: 'lm loss' (the objective), 'ce', 'numeric', 'digit_acc',
    'digit_cond_acc', 'digit_entropy', 'digit_abs_error', 'digit_logit', 'digit_logsumexp'
    (and 'numeric_grad_share', 'numeric_grad_cos' on a probed micro-batch); each value a
    2-element tensor [sum, count] to be summed over micro-batches and data-parallel ranks
    and divided. The
    Megatron-LM and Megatron-Bridge loops take theirs from models/megatron_lm.py.
    """
    output = _as_output(output)
    losses = output.per_token.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])}
    # the gradient probe's pairs on a probed micro-batch (NumericLossGPTModel.forward)
    pairs = {**report_pairs(output.stats), **probe_pairs(output.stats)}
    for name, (total, count) in pairs.items():
        report[name] = torch.stack([total, count]).to(loss_sum.dtype)
    return loss_sum, num_tokens, report


def report_names(probed: bool) -> list[str]:
    """The names `loss_func`'s reports hold, sorted, summed over micro-batches of which the
    first is `probed` or not: known on every pipeline stage without the last stage's report."""
    return sorted({"lm loss", *REPORT_PAIRS, *(GRAD_PROBE_PAIRS if probed else ())})


def _as_output(output: NumericLossOutput | tuple) -> NumericLossOutput:
    """The head's output, also from the plain tuple Float16Module makes of it; anything else
    (megatron's GPTModel's per-token CE, another model's output) refused, naming it."""
    if isinstance(output, NumericLossOutput):
        return output
    fields = len(NumericLossOutput._fields)
    if isinstance(output, tuple) and len(output) == fields and isinstance(output[1], dict):
        return NumericLossOutput(*output)
    got = f"a tensor {tuple(output.shape)}" if torch.is_tensor(output) else type(output).__name__
    raise TypeError(
        f"loss_func takes the numeric loss head's output (NumericLossGPTModel called with "
        f"labels and loss_mask), got {got}: is the model built by del_megatron's builder?"
    )
