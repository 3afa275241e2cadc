"""Hugging Face tensors <-> megatron-core tensors of the Llama family, one tensor at a time,
as the table in models/hf_names.py describes them (names, shapes, fusion, split, padding).

`rank_shard` reads, through a `SliceReader`, only the rows or columns of each Hugging Face
tensor that a rank holds: a rank never needs the whole checkpoint in memory. `hf_tensors` is
its inverse on a full (TP 1) tensor. Megatron names here are canonical: the local spec's
separate norms. Transformer Engine's spec fuses them into the next linear layer; `canonical`
and `spec_name` translate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .architecture import LlamaArchitecture
from .hf_config import ConversionError
from .hf_names import Bound, find, hf_shapes

# (hf_name, dim, start, stop) -> that slice of the tensor (dim None: the whole tensor)
SliceReader = Callable[[str, int | None, int | None, int | None], torch.Tensor]

TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
# Buffers some checkpoints carry that follow from the config (not weights).
DERIVED = (".rotary_emb.inv_freq",)


def canonical(name: str) -> str:
    """A megatron parameter name with Transformer Engine's fused norm names made local."""
    for local, te in TE_NORMS.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def spec_name(name: str, layer_norms_fused: bool) -> str:
    """A canonical name as a model with (or without) Transformer Engine's spec has it."""
    if layer_norms_fused:
        for local, te in TE_NORMS.items():
            if name.endswith(local):
                return name[: -len(local)] + te
    return name


def check_hf_tensors(found: dict[str, tuple[int, ...]], arch: LlamaArchitecture) -> None:
    """Every tensor `arch` needs is there with its shape, and nothing else is (a tensor we
    would not read changes the model's math): ConversionError naming the first mismatch."""
    expected = hf_shapes(arch)
    for name, shape in expected.items():
        if name not in found:
            raise ConversionError(f"tensor {name} is missing from the checkpoint")
        if tuple(found[name]) != shape:
            raise ConversionError(
                f"tensor {name} has shape {tuple(found[name])}, config.json implies {shape}"
            )
    tied_head = "lm_head.weight" if arch.tie_word_embeddings else None
    extra = sorted(
        n for n in found if n not in expected and n != tied_head and not n.endswith(DERIVED)
    )
    if extra:
        raise ConversionError(
            f"tensor {extra[0]} (and {len(extra) - 1} more) has no place in the model: "
            "the checkpoint has parts that config.json does not describe"
        )


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` grown to `size` along `dim` with zeros (the vocabulary padding)."""
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def pad_vocab(name: str, full: torch.Tensor, arch: LlamaArchitecture, padded_vocab: int):
    """A full (TP 1) canonical tensor with its vocabulary rows, if it has them, padded with
    zeros to `padded_vocab` rows whatever padding it had; other tensors unchanged."""
    if not find(name, arch).entry.padded:
        return full
    return _pad(full.narrow(0, 0, arch.vocab_size), 0, padded_vocab)


def _fuse(bound: Bound, parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The megatron tensor (or shard) of its Hugging Face parts (or their rank's slices)."""
    fusion = bound.entry.fusion
    if fusion is None:
        return parts[0]
    if fusion == "concat":
        return torch.cat(parts)
    tail = parts[0].shape[1:]  # qkv: interleaved by query group
    return torch.cat([p.reshape(groups, -1, *tail) for p in parts], dim=1).reshape(-1, *tail)


def _unfuse(bound: Bound, full: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """The Hugging Face parts of a full megatron tensor (inverse of `_fuse`)."""
    fusion = bound.entry.fusion
    rows = [shape[0] for shape in bound.shapes]
    if fusion is None:
        return [full]
    if fusion == "concat":
        return list(full.split(rows))
    tail = full.shape[1:]
    per_group = [r // groups for r in rows]
    split = full.reshape(groups, sum(per_group), *tail).split(per_group, dim=1)
    return [t.reshape(-1, *tail) for t in split]


def rank_shard(
    read: SliceReader,
    name: str,
    arch: LlamaArchitecture,
    padded_vocab: int,
    rank: int = 0,
    world: int = 1,
) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s shard of the canonical megatron tensor `name` (the whole
    tensor at world 1), read slice by slice from the Hugging Face tensors: the rank's
    `1/world` of each part along the split dim (for the vocabulary, of the padded rows,
    zeros past the real ones), fused. Equals `sharding.split` of the full tensor."""
    bound = find(name, arch)
    if bound.entry.partition is None:
        return read(bound.hf[0], None, None, None)
    dim = bound.entry.partition[0]
    parts = []
    for hf, shape in zip(bound.hf, bound.shapes, strict=True):
        per_rank = (padded_vocab if bound.entry.padded else shape[dim]) // world
        start, stop = rank * per_rank, (rank + 1) * per_rank
        real_stop = min(stop, shape[dim])
        if start < real_stop:
            part = read(hf, dim, start, real_stop)
        else:  # a shard of padding only: no rows to read, one read for the dtype
            part = read(hf, dim, 0, 1).narrow(dim, 0, 0)
        parts.append(_pad(part, dim, stop - start))
    return _fuse(bound, parts, arch.num_query_groups // world)


def reader_of(tensors: dict[str, torch.Tensor]) -> SliceReader:
    """A SliceReader over tensors in memory."""

    def read(name, dim, start, stop):
        try:
            t = tensors[name]
        except KeyError:
            raise ConversionError(f"tensor {name} is missing from the checkpoint") from None
        return t if dim is None else t.narrow(dim, start, stop - start)

    return read


def hf_tensors(
    name: str, full: torch.Tensor, arch: LlamaArchitecture
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one full (TP 1) canonical megatron tensor (vocabulary
    padding dropped)."""
    bound = find(name, arch)
    if bound.entry.padded:
        full = full[: arch.vocab_size]
    yield from zip(bound.hf, _unfuse(bound, full, arch.num_query_groups), strict=True)
