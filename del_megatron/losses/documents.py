"""Where the documents of a packed row start, in label positions (`document_starts_of`): from
megatron-core's `PackedSeqParams` (the THD format) to the bool tensor the loss reads
(`document_starts`, [b, s] as the labels), so that no number runs from one document into the
next.

What megatron gives, and what it means for the labels (read from megatron-core 0.16/0.19,
Megatron-LM's `pretrain_gpt.py`, `GPTDataset`, `SFTDataset` and Megatron-Bridge's packed
datasets):

* `cu_seqlens_q` [n + 1]: cumulative document lengths in *token* positions of the packed row
  (micro-batch size 1: THD attention squeezes the batch dimension). Without padding between
  documents, document i is tokens [cu[i], cu[i+1]).
* `cu_seqlens_q_padded` [n + 1] (Transformer Engine's naming): the *physical* offsets when
  documents are padded to a multiple (Bridge's `pad_seq_to_mult`, context parallelism): the
  tokens of document i are [p[i], p[i] + cu[i+1] - cu[i]), then padding up to p[i+1]. The
  row follows p; cu_seqlens_q is then logical (it does not index the row).
* Positions past the last offset (a tail of padding) are a segment of their own, as
  megatron-core's own `seq_idx` reads them.
* `cu_seqlens_kv` (and its padded form): equal to q's for self-attention; nothing else is
  read here, so anything else is refused.

Where the labels sit depends on how the loop's data set shifted them, which the parameters
do not say (`shifted`):

* "row" (Megatron-LM: `GPTDataset` with `--dataloader-inter-document-masking` and
  `SFTDataset` take tokens = row[:-1], labels = row[1:] of the whole packed row): the label
  at token position t is token t + 1, so a document's first label sits one position before
  its first token, at cu[i] - 1 (that position's input is the previous document's last token;
  Megatron-LM masks it for SFT prompts and with `--eod-mask-loss`, else it is trained across
  the boundary, as megatron's own CE does). A last offset equal to the row length closes the
  last document (the row's extra token is its continuation), it starts nothing.
* "document" (Megatron-Bridge: `GPTSFTPackedDataset` and in-batch packing shift each document
  on its own, tokens = doc[:-1], labels = doc[1:], before packing): labels sit at their
  document's token positions, starts at cu[i].

No host read: the starts are scattered on the device and the checks are device assertions
(a host read would stall every GPU micro-batch).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from ..errors import UserError

Shifted = Literal["row", "document"]


def document_starts_of(
    packed_seq_params, labels: torch.Tensor, *, shifted: Shifted
) -> torch.Tensor | None:
    """[b, s] bool, True at the first label position of each document (and of the padding
    after one) of the packed row whose labels are `labels` [b, s] (b = 1); None when
    `packed_seq_params` is None (unpacked rows: each row one document).

    packed_seq_params: megatron-core's `PackedSeqParams` as the model receives it;
    shifted: where the labels sit relative to the tokens, "row" (Megatron-LM's data sets) or
    "document" (Megatron-Bridge's), see the module docstring. What cannot be read exactly is
    refused in one line (`UserError`)."""
    if packed_seq_params is None:
        return None
    if shifted not in get_args(Shifted):
        raise ValueError(f"shifted must be one of {get_args(Shifted)}, got {shifted!r}")
    params = packed_seq_params
    if params.qkv_format != "thd":
        raise UserError(
            f"packed_seq_params.qkv_format is {params.qkv_format!r}: the numeric loss reads "
            "packed documents in megatron's 'thd' format only"
        )
    local_cp = getattr(params, "local_cp_size", None)
    if local_cp is not None and int(local_cp) > 1:
        raise UserError(
            f"packed_seq_params.local_cp_size={local_cp}: the numeric loss does not support "
            "context parallelism (each rank holds a slice of the packed row)"
        )
    logical = _offsets(params.cu_seqlens_q, "cu_seqlens_q")
    if logical is None:
        raise UserError("packed_seq_params has no cu_seqlens_q: the document boundaries")
    padded = _offsets(params.cu_seqlens_q_padded, "cu_seqlens_q_padded")
    physical = logical if padded is None else padded
    if physical.shape != logical.shape:
        raise UserError(
            f"packed_seq_params.cu_seqlens_q_padded has {physical.numel()} offsets and "
            f"cu_seqlens_q {logical.numel()}: they must describe the same documents"
        )
    _same_as_q(params, "cu_seqlens_kv", logical, "cu_seqlens_q")
    _same_as_q(params, "cu_seqlens_kv_padded", padded, "cu_seqlens_q_padded")
    if labels.dim() != 2 or labels.shape[0] != 1:
        raise UserError(
            f"packed documents (THD) come one packed row per micro-batch (micro-batch size 1); "
            f"labels are {tuple(labels.shape)}"
        )
    seq = labels.shape[1]
    device = labels.device
    logical, physical = logical.to(device, torch.long), physical.to(device, torch.long)
    lengths = logical[1:] - logical[:-1]  # each document's tokens, without its padding
    room = physical[1:] - physical[:-1]  # each document's tokens with its padding
    _assert(
        (physical >= 0).all()
        & (physical <= seq).all()
        & (lengths >= 0).all()
        & (room >= lengths).all(),
        f"packed_seq_params: cu_seqlens must grow from 0 to at most the row's {seq} tokens, "
        "each document within its padded span (cu_seqlens_q_padded)",
    )
    # token positions where a segment starts: each document (and the tail after the last
    # offset), and the padding after a document where it has any
    marks = torch.cat([physical, physical[:-1] + lengths])
    label_marks = marks - 1 if shifted == "row" else marks
    # a mark at the row's end starts nothing (for "row": it closes the last document, whose
    # continuation is the label at s - 1); a label mark before 0 is the row's own start
    keep = (marks < seq) & (label_marks >= 0)
    starts = torch.zeros(seq + 1, dtype=torch.bool, device=device)
    starts[torch.where(keep, label_marks, seq)] = True  # position seq: a sink, dropped
    starts[0] = True  # the row's first label begins its first document, however shifted
    return starts[:seq].unsqueeze(0)


def _offsets(value, name: str) -> torch.Tensor | None:
    """A cu_seqlens field as a 1-D tensor ([1, n] as the batch dict keeps it is squeezed)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise UserError(f"packed_seq_params.{name} must be a tensor, got {type(value).__name__}")
    if value.dim() == 2 and value.shape[0] == 1:
        value = value[0]
    if value.dim() != 1 or value.numel() < 2:
        raise UserError(
            f"packed_seq_params.{name} must be 1-D cumulative offsets [documents + 1], "
            f"got shape {tuple(value.shape)}"
        )
    return value


def _same_as_q(params, kv_name: str, q: torch.Tensor | None, q_name: str) -> None:
    """Self-attention: the kv offsets, where given, are q's (anything else is a layout this
    module does not read)."""
    kv = _offsets(getattr(params, kv_name, None), kv_name)
    if kv is None or kv is q:
        return
    message = (
        f"packed_seq_params.{kv_name} differs from {q_name}: the numeric loss reads packed "
        "documents of self-attention only (the same boundaries for queries and keys)"
    )
    if q is None or kv.shape != q.shape:
        raise UserError(message)
    _assert((kv.to(q.device) == q).all(), message)


def _assert(condition: torch.Tensor, message: str) -> None:
    """A device assertion (no host read on a GPU); on CPU it raises at once, as a UserError."""
    try:
        torch._assert_async(condition, message)
    except RuntimeError:
        raise UserError(message) from None
