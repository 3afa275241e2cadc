"""The megatron-core adapter: a GPTModel whose loss is the numeric loss on vocabulary shards,
and a `loss_func` following megatron-core's contract for `get_forward_backward_func`."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from ..losses import DigitVocab, NumericLossConfig, report_pairs, vocab_parallel_numeric_loss
from ..losses.reference import emo_cost_embedding

STATS_ATTRIBUTE = "numeric_stats"  # per-token loss tensors carry their statistics here


class NumericLossGPTModel(GPTModel):
    """GPTModel that, called with labels, returns per-token numeric losses [b, s].

    The returned tensor carries the loss statistics as `.numeric_stats` (0-dim sums and
    counts) for `loss_func`. Pass `loss_mask=` to forward so that masked positions end numbers
    and do not count as digit positions.
    """

    def __init__(self, *args, digit_vocab: DigitVocab, loss_config: NumericLossConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.digit_vocab = digit_vocab
        self.loss_config = loss_config
        self._loss_mask: torch.Tensor | None = None
        self.last_numeric_stats: dict[str, torch.Tensor] | None = None
        if loss_config.kind == "emo":
            # EMO's cost embedding [V/tp, h] is frozen from the weights the run starts from:
            # a buffer, so it is in every checkpoint and a resume uses the one it started
            # with (not one made from the trained weights); the safetensors weights and
            # the HF export hold parameters only.
            self.register_buffer(
                "emo_cost_embedding",
                emo_cost_embedding(self.shared_embedding_or_output_weight()),
                persistent=True,
            )
        else:
            self.emo_cost_embedding = None

    def freeze_emo_cost_embedding(self) -> None:
        """Take EMO's cost embedding again from the current output weights (this rank's
        rows): call it after loading initial weights into a built model (the trainer does).
        Without it, the weights at construction are the ones it is taken from."""
        if self.loss_config.kind == "emo" and self.emo_cost_embedding is not None:
            with torch.no_grad():
                self.emo_cost_embedding.copy_(
                    emo_cost_embedding(self.shared_embedding_or_output_weight())
                )

    def forward(self, *args, loss_mask: torch.Tensor | None = None, **kwargs):
        self._loss_mask = loss_mask
        try:
            return super().forward(*args, loss_mask=loss_mask, **kwargs)
        finally:
            self._loss_mask = None

    def _cost_embedding(self) -> torch.Tensor | None:
        if self.loss_config.kind != "emo":
            return None
        if self.emo_cost_embedding is None:
            raise ValueError(
                "loss kind 'emo' needs the model built with kind 'emo' (its cost embedding "
                "is a buffer made at construction)"
            )
        return self.emo_cost_embedding

    def _per_token(self, out) -> torch.Tensor:
        per_token = out.per_token
        setattr(per_token, STATS_ATTRIBUTE, out.stats)
        # also kept here: wrappers may hand on a new tensor (DeepSpeed ZeRO-3 does)
        self.last_numeric_stats = out.stats
        return per_token

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor):
        """labels [b, s], logits [s, b, V/tp] -> per-token losses [b, s]."""
        out = vocab_parallel_numeric_loss(
            logits,
            labels,
            self.digit_vocab,
            self.loss_config,
            self._loss_mask,
            group=self.pg_collection.tp,
            cost_embedding=self._cost_embedding(),
        )
        return self._per_token(out)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """With labels and loss_config.fused_output: the output layer and the loss in token
        chunks (hidden [s, b, h] -> per-token losses [b, s]); otherwise megatron-core's own
        (output layer, then compute_language_model_loss)."""
        if labels is None or not self.loss_config.fused_output or self.config.sequence_parallel:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, *args, **kwargs
            )
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        from ..losses.fused import vocab_parallel_fused_numeric_loss
        from .device import fused_chunk_tokens

        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        # as in megatron's output layer: identity forward, all-reduce of the input gradient
        # (each rank's is a partial sum over its vocabulary shard) in backward
        hidden = copy_to_tensor_model_parallel_region(hidden_states, group=self.pg_collection.tp)
        out = vocab_parallel_fused_numeric_loss(
            hidden,
            weight,
            labels,
            self.digit_vocab,
            self.loss_config,
            self._loss_mask,
            group=self.pg_collection.tp,
            cost_embedding=self._cost_embedding(),
            chunk_tokens=fused_chunk_tokens(hidden.device, self.loss_config.fused_chunk_tokens),
        )
        return self._per_token(out)


def loss_func(
    loss_mask: torch.Tensor,
    output_tensor: torch.Tensor,
    stats: dict[str, torch.Tensor] | None = None,
):
    """megatron-core loss function: (loss sum, token count, report dict of [sum, count]).

    output_tensor: per-token losses [b, s] from NumericLossGPTModel. Report keys: 'lm loss'
    (the objective), 'ce', 'numeric', 'digit_acc', 'digit_cond_acc', 'digit_entropy',
    'digit_abs_error'; each value a 2-element tensor [sum, count] to be summed over
    micro-batches and data-parallel ranks and divided. stats: the model's
    `last_numeric_stats`, for wrappers that do not hand on the model's own output tensor.
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])}
    stats = stats if stats is not None else getattr(output_tensor, STATS_ATTRIBUTE, None)
    if stats is not None:
        for name, (total, count) in report_pairs(stats).items():
            report[name] = torch.stack([total, count]).to(loss_sum.dtype)
    return loss_sum, num_tokens, report
