"""The numeric loss as one component of a model: `NumericLossHead`.

Given this rank's hidden states and output-weight shard (fused) or its logits shard
(unfused), the labels, the loss mask and the tensor-parallel group, it returns a
`NumericLossOutput`: per-token losses [b, s] and statistics, tensors on the compute device.
It owns what the loss needs beyond its inputs, so that nothing else has to:

* EMO's cost embedding, a persistent buffer taken from the output weights the run starts
  from (`take_cost_embedding`): in every checkpoint, so a resume uses the one the run started
  with; HF export, which writes parameters only, leaves it out.
* the choice between the two ops (`fused`: `loss.fused_output`), the fused op's chunk size
  (`loss.fused_chunk_tokens`; 0 takes the op's one default, `fused.default_chunk_tokens`)
  and its `loss.fused_recompute` option.
* whether its caller promises the fused op a backward of the loss' own gradient times one
  factor (`promise_scaled_loss`: the trainer does), so that the op's backward reads nothing
  from the device.

It lives beside the ops (layer 2) rather than in models/: it needs nothing of megatron-core
but the group it is handed, and both the megatron adapter (models/gpt.py) and the tests use
it the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .assemble import NumericLossOutput
from .config import NumericLossConfig
from .fused import default_chunk_tokens, vocab_parallel_fused_numeric_loss
from .reference import emo_cost_embedding
from .vocab import DigitVocab
from .vocab_parallel import vocab_parallel_numeric_loss


class NumericLossHead(torch.nn.Module):
    """The numeric loss of `cfg` on vocabulary shards, with the state it needs.

    output_weight: this rank's output-layer rows [V/tp, h] at construction, from which EMO's
    cost embedding is taken (only read for a kind that has one).
    promise_scaled_loss: backward through this head will be of the per-token losses' sum over
    the loss mask (`models.gpt.loss_func`) times one factor; see
    `vocab_parallel_fused_numeric_loss`. Where another weighting may follow, leave it False.
    """

    def __init__(
        self,
        vocab: DigitVocab,
        cfg: NumericLossConfig,
        output_weight: torch.Tensor | None = None,
        *,
        promise_scaled_loss: bool = False,
    ):
        super().__init__()
        self.vocab = vocab
        self.cfg = cfg
        self.promise_scaled_loss = promise_scaled_loss
        cost = None
        if cfg.kind_spec.needs_cost_embedding:
            if output_weight is None:
                raise ValueError(
                    f"kind={cfg.kind!r} needs the output weights its cost embedding is taken from"
                )
            cost = emo_cost_embedding(output_weight)
        # None for the other kinds: a None buffer is in no state dict
        self.register_buffer("emo_cost_embedding", cost, persistent=True)

    @property
    def fused(self) -> bool:
        """Whether the head takes hidden states and the output weight (the fused op) rather
        than logits."""
        return self.cfg.fused_output

    def chunk_tokens(self, device: torch.device) -> int:
        """Tokens per chunk of the fused op on `device`."""
        return self.cfg.fused_chunk_tokens or default_chunk_tokens(device)

    def take_cost_embedding(self, output_weight: torch.Tensor) -> None:
        """Take EMO's cost embedding again from `output_weight` [V/tp, h] (this rank's rows):
        after initial weights are loaded into a built model (the trainer does). No-op for a
        kind without one."""
        if self.emo_cost_embedding is not None:
            with torch.no_grad():
                self.emo_cost_embedding.copy_(emo_cost_embedding(output_weight))

    def forward(
        self,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        *,
        hidden: torch.Tensor | None = None,
        output_weight: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> NumericLossOutput:
        """labels, loss_mask [b, s]; either hidden [s, b, h] (not sequence-parallel) with
        output_weight [V/tp, h] (when `fused`), or logits [s, b, V/tp]. Gradients reach them
        through autograd. Every rank of `group` returns the same output."""
        if (hidden is None) == (logits is None):
            raise ValueError("NumericLossHead takes either hidden (with output_weight) or logits")
        if logits is not None:
            return vocab_parallel_numeric_loss(
                logits,
                labels,
                self.vocab,
                self.cfg,
                loss_mask,
                group,
                cost_embedding=self.emo_cost_embedding,
            )
        if output_weight is None:
            raise ValueError("NumericLossHead: hidden needs output_weight (this rank's rows)")
        return vocab_parallel_fused_numeric_loss(
            hidden,
            output_weight,
            labels,
            self.vocab,
            self.cfg,
            loss_mask,
            group,
            cost_embedding=self.emo_cost_embedding,
            chunk_tokens=self.chunk_tokens(hidden.device),
            recompute=self.cfg.fused_recompute,
            promise_scaled_loss=self.promise_scaled_loss,
        )
