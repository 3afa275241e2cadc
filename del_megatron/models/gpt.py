"""The megatron-core adapter: a GPTModel whose loss is `NumericLossHead`, and a `loss_func`
following megatron-core's contract for `get_forward_backward_func`."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from ..losses import DigitVocab, NumericLossConfig, NumericLossHead, report_pairs
from ..losses.assemble import NumericLossOutput


class NumericLossGPTModel(GPTModel):
    """GPTModel whose loss is the numeric loss head (`self.head`).

    Called with labels and `loss_mask=` (labels, loss_mask [b, s]), forward returns the head's
    `NumericLossOutput`: per-token losses [b, s] and statistics; `loss_func` turns it into
    megatron's (loss sum, token count, report). Without labels it returns megatron's logits
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
        if self.config.mtp_num_layers is not None:
            raise ValueError("multi-token prediction is not supported with the numeric loss head")
        # the cost embedding (emo) is taken from the weights at construction; see
        # freeze_emo_cost_embedding for weights loaded afterwards
        weight = self.output_weight() if self.post_process else None
        self.head = NumericLossHead(
            digit_vocab, loss_config, weight, promise_scaled_loss=promise_scaled_loss
        )
        self.register_load_state_dict_pre_hook(emo_buffer_saved_before_the_head)

    def output_weight(self) -> torch.Tensor:
        """This rank's output-layer rows [V/tp, h] (the embedding's when they are tied)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def freeze_emo_cost_embedding(self) -> None:
        """Take EMO's cost embedding again from the current output weights (this rank's
        rows): call it after loading initial weights into a built model (the trainer does).
        Without it, the weights at construction are the ones it is taken from."""
        self.head.take_cost_embedding(self.output_weight())

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """With labels: the loss head, on the hidden states [s, b, h] and the output weight
        when the head is fused (the output layer and the loss in token chunks), else on the
        output layer's logits [s, b, V/tp]. Without labels: megatron-core's own."""
        if labels is None or not self.post_process:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, *args, **kwargs
            )
        loss_mask = kwargs.get("loss_mask")
        group = self.pg_collection.tp
        weight = self.output_weight()
        if self.head.fused and not self.config.sequence_parallel:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            # as in megatron's output layer: identity forward, all-reduce of the input
            # gradient (each rank's is a partial sum over its vocabulary shard) in backward
            hidden = copy_to_tensor_model_parallel_region(hidden_states, group=group)
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


def loss_func(loss_mask: torch.Tensor, output: NumericLossOutput):
    """megatron-core loss function: (loss sum, token count, report dict of [sum, count]).

    output: what NumericLossGPTModel returns with labels (per-token losses [b, s] and their
    statistics); loss_mask [b, s]. In a stock Megatron-LM loop, forward_step returns
    `output, partial(loss_func, loss_mask)`. Report keys: 'lm loss' (the objective), 'ce',
    'numeric', 'digit_acc', 'digit_cond_acc', 'digit_entropy', 'digit_abs_error'; each value
    a 2-element tensor [sum, count] to be summed over micro-batches and data-parallel ranks
    and divided.
    """
    losses = output.per_token.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])}
    for name, (total, count) in report_pairs(output.stats).items():
        report[name] = torch.stack([total, count]).to(loss_sum.dtype)
    return loss_sum, num_tokens, report
