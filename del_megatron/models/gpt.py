"""The megatron-core adapter: a GPTModel whose loss is `NumericLossHead`, and a `loss_func`
following megatron-core's contract for `get_forward_backward_func`."""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from functools import partial
from typing import NamedTuple

import torch
from megatron.core.models.gpt import GPTModel

from ..errors import UserError
from ..losses import REPORT_PAIRS, DigitVocab, NumericLossConfig, NumericLossHead, report_pairs
from ..losses.assemble import NumericLossOutput, NumericStats
from ..losses.diagnostics import GRAD_PROBE_PAIRS, output_gradient_probe, probe_pairs
from ..losses.documents import Shifted, document_starts_of
from ..losses.head import COST_EMBEDDING, cost_embedding_hidden
from ..losses.reference import emo_cost_embedding

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


def _refuse_packed(packed_seq_params, packed_labels: Shifted | None) -> None:
    """Packed documents refused where the model does not know where its loop puts the labels
    (`packed_labels`): the head ends digit runs at document starts, which sit one position
    earlier in Megatron-LM's data sets than in Megatron-Bridge's (`losses.documents`); read
    wrongly, two documents that meet digit-to-digit are one number (numeric term 0.3326
    against 0.2340 as separate rows, issue 51)."""
    if packed_seq_params is not None and packed_labels is None:
        raise UserError(
            "packed documents (packed_seq_params) need the loop's label layout: build the "
            "model with megatron_lm.numeric_builder / numeric_loss_hook (Megatron-LM) or "
            "megatron_bridge.NumericLossGPTModelProvider (Megatron-Bridge), or train on "
            "unpacked rows"
        )


# megatron-core 0.18 and later end GPTModel's forward in a caller's `output_processor`,
# handed the decoder's hidden states [s, b, h], the output layer and `scale_logits` (muP's
# logit multiplier), in place of its own logits and loss: the head goes through it there.
# Read from the installed forward, not a version string. Without it (0.16, 0.17) the head
# overrides the private `_postprocess`.
HAS_OUTPUT_PROCESSOR = "output_processor" in inspect.signature(GPTModel.forward).parameters


class HeadCall(NamedTuple):
    """What one forward asks of the head beyond megatron's arguments: megatron's
    `output_processor_context` for `NumericLossGPTModel._numeric_output`."""

    probe: bool = False
    """Measure the numeric term's gradient share (`numeric_grad_probe`)."""


def refuse_mup_without_output_processor(config) -> None:
    """muP (`use_mup`, megatron-core 0.17+) refused in one line where GPTModel has no
    `output_processor`: the `_postprocess` override reads the output layer's logits before
    megatron's `_scale_logits` (mup_output_mult) (objective 5.8001 against 5.8061 on the
    model's own logits, issue 51)."""
    if getattr(config, "use_mup", False) and not HAS_OUTPUT_PROCESSOR:
        raise UserError(
            "use_mup=True (--use-mup) needs megatron-core 0.18 or later (GPTModel's "
            "output_processor, after its muP logit scaling): upgrade megatron-core or drop "
            "--use-mup"
        )


def _same(logits: torch.Tensor) -> torch.Tensor:
    """The logit scaling of a megatron-core without muP: none."""
    return logits


class NumericLossGPTModel(GPTModel):
    """GPTModel whose loss is the numeric loss head (`self.head`).

    Called with labels and `loss_mask=` (labels, loss_mask [b, s]), forward returns the head's
    `NumericLossOutput`: per-token losses [b, s] and statistics; `loss_func` turns it into
    megatron's (loss sum, token count, report). Labels without `loss_mask=` are refused
    (outside `labels_carry_the_mask`). Without labels it returns megatron's logits
    [b, s, V/tp]. EMO's cost embedding is the head's buffer `head.emo_cost_embedding`.
    promise_scaled_loss: backward will be of `loss_func`'s loss sum times one factor (the
    trainer's); the head's fused op then makes no host read (`NumericLossHead`).
    packed_labels: where the loop that calls it puts the labels of packed documents
    (`packed_seq_params`), "row" (Megatron-LM) or "document" (Megatron-Bridge), read by
    `losses.documents.document_starts_of`; None (this project's trainer, which never packs)
    refuses packed documents. Configuration of the build, as the head's.
    """

    packed_labels: Shifted | None = None

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
        packed_labels: Shifted | None = None,
    ) -> NumericLossGPTModel:
        """`model`, built by another loop's own builder (Megatron-LM's, Megatron-Bridge's
        provider), made this class in place: the same module, parameters and architecture
        (every field that builder read), ending in the loss head. Its class becomes this one
        and it gains the head (and `packed_labels`, its loop's), nothing else."""
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
        model.packed_labels = packed_labels
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
        # the cost embedding (emo) is taken from the weights at construction (a run from its
        # random init); from weights loaded afterwards by freeze_emo_cost_embedding (the
        # trainer, take_emo_cost_embedding after Bridge's HF import) or, from a checkpoint
        # without it, by emo_buffer_saved_before_the_head (megatron's loops' checkpoint load)
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
        rows): call it after loading initial weights into a built model (the trainer does;
        `take_emo_cost_embedding`, a pre-wrap hook, in megatron's loops). Without it, the
        weights at construction are the ones it is taken from. Nothing to take on a pipeline
        stage without the output layer."""
        if self.head is not None:
            self.head.take_cost_embedding(self.output_weight())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron's sharded state dict (distributed checkpoints), with EMO's cost embedding
        declared as what it is: this rank's rows [V/tp, h] of a [V, h] tensor, sharded over
        tensor-parallel ranks along dim 0 like the output weight it is taken from (megatron's
        default for a buffer of a plain module is a tensor replicated over them, which keeps
        one rank's rows only). Left out within `hide_loss_modules()`."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        cost = self.head.saved_cost_embedding() if self.head is not None else None
        if cost is not None:
            sharded.update(
                make_sharded_tensors_for_checkpoint(
                    {COST_EMBEDDING: cost},
                    f"{prefix}head.",
                    {COST_EMBEDDING: 0},
                    sharded_offsets,
                    tp_group=self.pg_collection.tp,
                    dp_cp_group=metadata["dp_cp_group"],
                )
            )
        return sharded

    def hide_loss_modules(self):
        """A context in which the head's state (EMO's cost embedding) is in no state dict.

        The name is ModelOpt's (its distillation model's loss modules); megatron's loops enter
        it for each model chunk where they load weights that were not saved with the loss's
        state: Megatron-LM's and Megatron-Bridge's `load_checkpoint` with `finetune`
        (`--finetune`, `--pretrained-checkpoint`, Bridge's `checkpoint.pretrained_checkpoint`)
        and Bridge's HF import. The load then asks the checkpoint for no cost embedding (at
        megatron's default strictness, one it lacks was a CheckpointException) and takes it
        from the loaded output weights (`emo_buffer_saved_before_the_head`): a fine-tuning
        run's own starting weights, as for every new run."""
        return cost_embedding_hidden()

    def forward(self, *args, numeric_grad_probe: bool = False, **kwargs):
        """megatron-core's forward; with labels (and `loss_mask=`) its loss is the head's
        (`_head_output`), on the logits megatron's own loss would read: through GPTModel's
        `output_processor` where it has one (`HAS_OUTPUT_PROCESSOR`), after everything it
        does before its loss, muP's logit scaling included; else through the `_postprocess`
        override. A caller's own `output_processor` runs in place of the head, as it runs in
        place of megatron's logits and loss (GPTModel's contract): its result is the output.

        `numeric_grad_probe=True` (with `labels=` and `loss_mask=` as keywords) also measures
        the numeric term's share of the gradient at the output layer's logits
        (`losses.diagnostics`), added to the statistics as the probe's [sum, count] keys. An
        argument of the call, not state of the model: the trainer passes it on one
        micro-batch of a log step. Nothing is probed where there is nothing to probe: a kind
        without a digit term, a stage without the output layer, or the fused head
        (`loss.fused_output`), whose logits never exist as a tensor. Packed documents
        (`packed_seq_params`) end digit runs at each document's start (`packed_labels`)."""
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        if self.post_process and labels is not None:
            _refuse_packed(kwargs.get("packed_seq_params"), self.packed_labels)
        if kwargs.get("output_processor") is not None:
            if numeric_grad_probe:
                raise ValueError(
                    "numeric_grad_probe probes the numeric loss head, which the "
                    "output_processor passed replaces"
                )
            return super().forward(*args, **kwargs)
        probe = numeric_grad_probe and self._probed()
        if probe and (labels is None or len(args) > 4):
            raise ValueError("numeric_grad_probe needs labels= (and loss_mask=) as keywords")
        if HAS_OUTPUT_PROCESSOR:
            if labels is not None:
                kwargs["output_processor"] = self._numeric_output
                kwargs["output_processor_context"] = HeadCall(probe=probe)
            return super().forward(*args, **kwargs)
        if not probe:
            return super().forward(*args, **kwargs)  # the head in `_postprocess`
        # no hook to hand the probe to: the head on megatron's own logits, [b, s, V/tp]
        labels, loss_mask = kwargs.pop("labels"), kwargs.pop("loss_mask", None)
        logits = super().forward(*args, labels=None, **kwargs).transpose(0, 1)  # [s, b, V/tp]
        return self._head_output(
            labels,
            loss_mask,
            logits=logits,
            probe=True,
            packed_seq_params=kwargs.get("packed_seq_params"),
        )

    def _numeric_output(
        self,
        *,
        hidden_states,
        labels,
        loss_mask,
        context: HeadCall,
        scale_logits,
        packed_seq_params=None,
        **megatron,
    ) -> NumericLossOutput:
        """megatron's `output_processor` (0.18+), called by GPTModel where it would form its
        logits and loss: the decoder's hidden states [s, b, h] after multi-token prediction
        (refused with the head), labels, loss_mask [b, s], `scale_logits` (its muP logit
        multiplier), `packed_seq_params` and `context`, this forward's `HeadCall`. Its other
        helpers (the output layer and weight: the model's own; compute_language_model_loss:
        the loss the head replaces) are not needed."""
        return self._head_output(
            labels,
            loss_mask,
            hidden_states=hidden_states,
            scale_logits=scale_logits,
            probe=context.probe,
            packed_seq_params=packed_seq_params,
        )

    def _head_output(
        self,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        *,
        hidden_states: torch.Tensor | None = None,
        scale_logits=None,
        logits: torch.Tensor | None = None,
        probe: bool = False,
        packed_seq_params=None,
    ) -> NumericLossOutput:
        """The head's output, its one call site (megatron's hook, the `_postprocess`
        override, the probe without the hook). labels, loss_mask [b, s]; either the output
        layer's input hidden_states [s, b, h] with `scale_logits` (megatron's logit scaling,
        the identity without muP), or this rank's logits [s, b, V/tp], scaled already. The
        fused head (`loss.fused_output`: output layer and loss in token chunks) takes the
        hidden states and the weight, but under sequence parallelism (hidden states split
        along s) it takes the logits. probe: add the gradient probe's statistics (`forward`).
        packed_seq_params: megatron's packed documents (THD), whose starts end digit runs."""
        loss_mask = _required_loss_mask(loss_mask)
        group = self.pg_collection.tp
        _refuse_packed(packed_seq_params, self.packed_labels)
        starts = document_starts_of(packed_seq_params, labels, shifted=self.packed_labels)
        head = partial(self.head, document_starts=starts)
        if logits is None:
            weight = self.output_weight()
            if self.head.fused and not self.config.sequence_parallel:
                from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

                # megatron's _scale_logits multiplies by one number (mup_output_mult), which
                # commutes with the output layer's matmul (no bias): the logits of the scaled
                # hidden states are its scaled logits, which the fused op never forms
                scaled = scale_logits(hidden_states)
                # as in megatron's output layer: identity forward, all-reduce of the input
                # gradient (each rank's is a partial sum over its vocabulary shard) in backward
                hidden = copy_to_tensor_model_parallel_region(scaled, group=group)
                self._before_reading_output_weight(hidden_states)
                return head(labels, loss_mask, group, hidden=hidden, output_weight=weight)
            logits, _ = self.output_layer(
                hidden_states, weight=weight if self.share_embeddings_and_output_weights else None
            )
            logits = scale_logits(logits)
        output = head(labels, loss_mask, group, logits=logits)
        if not probe:
            return output

        def loss_of(copy: torch.Tensor) -> NumericLossOutput:
            # the head's op called as a function: the head module itself runs once a forward,
            # as DeepSpeed's ZeRO 3 traces each module's calls
            return self.head.forward(labels, loss_mask, group, logits=copy, document_starts=starts)

        measured = output_gradient_probe(loss_of, logits, self.head.cfg.resolved_alpha, group)
        return output._replace(stats=NumericStats({**output.stats, **measured}))

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

    if not HAS_OUTPUT_PROCESSOR:

        def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
            """megatron-core without `output_processor` (0.16, 0.17): with labels, the head
            (`_head_output`) on the hidden states [s, b, h] where GPTModel would form its
            logits and loss; muP, whose scaling this private seam does not apply, refused.
            Without labels: megatron-core's own."""
            if labels is None or not self.post_process:
                return super()._postprocess(
                    hidden_states, input_ids, position_ids, labels, *args, **kwargs
                )
            refuse_mup_without_output_processor(self.config)
            return self._head_output(
                labels,
                kwargs.get("loss_mask"),
                hidden_states=hidden_states,
                scale_logits=_same,
                packed_seq_params=kwargs.get("packed_seq_params"),
            )


def emo_buffer_saved_before_the_head(module, state_dict, prefix, *args) -> None:
    """EMO's cost embedding of a state dict loaded into `module` (a load_state_dict pre-hook,
    so before any of it is copied): checkpoints saved before the loss head (2026-12-01) kept it
    as the model's own buffer `emo_cost_embedding`, read as the head's; a state dict without it
    (a checkpoint of another loss, megatron's own GPTModel, or one loaded within
    `hide_loss_modules()`) gets it taken from the output weights it loads, said in one line.
    Before, a run continued from such a checkpoint trained against the cost embedding of the
    weights at construction (the random init, or uninitialised memory)."""
    old = prefix + COST_EMBEDDING
    key = prefix + "head." + COST_EMBEDDING
    if old in state_dict:
        state_dict[key] = state_dict.pop(old)
    head = module.head
    if key in state_dict or head is None or head.emo_cost_embedding is None:
        return
    weight = module.output_weight()
    name = next((n for n, p in module.named_parameters() if p is weight), None)
    loaded = state_dict.get(prefix + name) if name is not None else None
    if loaded is None:  # no output weights loaded: the head reports its key missing
        return
    state_dict[key] = emo_cost_embedding(loaded)
    if (
        not torch.distributed.is_initialized()
        or torch.distributed.get_rank(module.pg_collection.tp) == 0
    ):
        logging.getLogger(__name__).warning(
            "EMO: no cost embedding in the state loaded (%s: a checkpoint without it, or a "
            "fine-tuning load); taken from the output weights it loads (%s)",
            key,
            prefix + name,
        )


def take_emo_cost_embedding(models: list) -> list:
    """A pre-wrap hook (megatron's model chunks, after the hooks that load their weights):
    EMO's cost embedding of each taken from its loaded output weights. Megatron-Bridge's
    AutoBridge loads the Hugging Face weights in such a hook, after the model is built
    (`megatron_bridge.NumericLossGPTModelProvider.from_provider` registers this one after
    it); before, EMO trained against the cost embedding of the uninitialised memory the
    model was built with."""
    for model in models:
        if isinstance(model, NumericLossGPTModel):
            model.freeze_emo_cost_embedding()
    return models


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
