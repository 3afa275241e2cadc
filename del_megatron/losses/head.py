"""The numeric loss as one component of a model: `NumericLossHead`.

Given this rank's hidden states and output-weight shard (fused) or its logits shard
(unfused), the labels, the loss mask and the tensor-parallel group, it returns a
`NumericLossOutput`: per-token losses [b, s] and statistics, tensors on the compute device.
It owns what the loss needs beyond its inputs, so that nothing else has to:

* EMO's cost embedding, a buffer taken from the output weights the run starts from
  (`take_cost_embedding`), float32 whatever the model's dtype: in every checkpoint (the head
  writes and reads it itself, see `NumericLossHead._save_to_state_dict`), so a resume uses the
  one the run started with; HF export, which writes the model's weights only, leaves it out.
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

import contextlib
import contextvars

import torch
import torch.distributed as dist

from .assemble import NumericLossOutput
from .config import NumericLossConfig
from .fused import default_chunk_tokens, vocab_parallel_fused_numeric_loss
from .reference import emo_cost_embedding
from .vocab import DigitVocab
from .vocab_parallel import vocab_parallel_numeric_loss

COST_EMBEDDING = "emo_cost_embedding"  # the buffer's name (its key in a state dict)
# True within `cost_embedding_hidden()`
_COST_EMBEDDING_HIDDEN = contextvars.ContextVar("cost_embedding_hidden", default=False)


@contextlib.contextmanager
def cost_embedding_hidden():
    """Within it, every head leaves EMO's cost embedding out of its state dict (and so out of
    the model's sharded state dict): for a load of weights made without it, which then takes it
    from the loaded output weights (`models.gpt.NumericLossGPTModel.hide_loss_modules`)."""
    token = _COST_EMBEDDING_HIDDEN.set(True)
    try:
        yield
    finally:
        _COST_EMBEDDING_HIDDEN.reset(token)


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
        # None for the other kinds. Registered non-persistent and saved by the head itself
        # (_save_to_state_dict): it is no weight of the model, and Megatron-Bridge's HF import
        # and export look up an HF name for every persistent buffer of a model (a buffer with
        # none failed both: 'NoneType' object has no attribute 'megatron_module')
        self.register_buffer(COST_EMBEDDING, cost, persistent=False)

    @property
    def fused(self) -> bool:
        """Whether the head takes hidden states and the output weight (the fused op) rather
        than logits."""
        return self.cfg.fused_output

    def chunk_tokens(self, device: torch.device) -> int:
        """Tokens per chunk of the fused op on `device`."""
        return self.cfg.fused_chunk_tokens or default_chunk_tokens(device)

    def take_cost_embedding(self, output_weight: torch.Tensor) -> None:
        """Take EMO's cost embedding again from `output_weight` [V/tp, h] (this rank's rows),
        in float32: after initial weights are loaded into a built model (the trainer does;
        `models.gpt` for megatron's loops). No-op for a kind without one."""
        if self.emo_cost_embedding is not None:
            with torch.no_grad():
                self.emo_cost_embedding.copy_(emo_cost_embedding(output_weight))

    def saved_cost_embedding(self) -> torch.Tensor | None:
        """EMO's cost embedding [V/tp, h] as a checkpoint keeps it; None for a kind without
        one and within `cost_embedding_hidden()`."""
        return None if _COST_EMBEDDING_HIDDEN.get() else self.emo_cost_embedding

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """torch's, and EMO's cost embedding (a non-persistent buffer, see __init__)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        cost = self.saved_cost_embedding()
        if cost is not None:
            destination[prefix + COST_EMBEDDING] = cost if keep_vars else cost.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        """torch's, and EMO's cost embedding read as a persistent buffer would be (missing
        when absent, a shape mismatch an error), kept float32."""
        key = prefix + COST_EMBEDDING
        saved = state_dict.pop(key, None)  # not a key torch would know (non-persistent)
        cost = self.emo_cost_embedding
        if cost is None:
            if saved is not None:
                unexpected_keys.append(key)
        elif saved is None:
            if strict:
                missing_keys.append(key)
        elif saved.shape != cost.shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {tuple(saved.shape)} from "
                f"checkpoint, the shape in current model is {tuple(cost.shape)}."
            )
        elif local_metadata.get("assign_to_params_buffers", False):
            self.register_buffer(COST_EMBEDDING, saved.float(), persistent=False)
        else:
            with torch.no_grad():
                cost.copy_(saved)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )

    def _apply(self, fn, recurse=True):
        """torch's (`.to()`, `.cuda()`, `.bfloat16()`, ...), with EMO's cost embedding kept
        float32: megatron's Float16Module casts every floating buffer of the model it wraps
        (every bf16 and fp16 run of Megatron-LM and Megatron-Bridge); the cost embedding goes
        to the new device with its float32 values."""
        cost = self.emo_cost_embedding
        super()._apply(fn, recurse)
        moved = self.emo_cost_embedding
        if cost is not None and moved is not None and moved.dtype != cost.dtype:
            self.register_buffer(COST_EMBEDDING, cost.to(moved.device), persistent=False)
        return self

    def forward(
        self,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        *,
        hidden: torch.Tensor | None = None,
        output_weight: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        document_starts: torch.Tensor | None = None,
    ) -> NumericLossOutput:
        """labels, loss_mask [b, s]; either hidden [s, b, h] (not sequence-parallel) with
        output_weight [V/tp, h] (when `fused`), or logits [s, b, V/tp]. Gradients reach them
        through autograd. Every rank of `group` returns the same output.
        document_starts: [b, s] bool, True at the first label position of each document of a
        packed row (`losses.documents.document_starts_of`): numbers end there; None, every
        row is one document."""
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
                document_starts=document_starts,
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
            document_starts=document_starts,
        )
