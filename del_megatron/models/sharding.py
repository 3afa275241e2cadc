"""Tensor-parallel split and merge of megatron-core tensors: the one place that cuts a full
(TP 1) tensor into ranks' shards and puts it back together.

A parameter is partitioned along `dim` in `world * stride` chunks, rank r taking chunks
r, r + world, ... (stride 2 for SwiGLU's fused [gate; up], so rank r holds [gate_r; up_r]):
the split megatron-core's CPU initialization uses. Which parameters are partitioned, and
how, comes from the attributes megatron-core sets (`partition_dim`, `partition_stride`) or,
without a model, from PARTITIONS, read off the Hugging Face name table (models/hf_names.py,
which a test checks against a built model).
"""

from __future__ import annotations

import torch

from .hf_names import Partition, partitions

# (partition dim, stride) of megatron-core's tensor-parallel parameters by name suffix; the
# others (norms) are replicated on every rank.
PARTITIONS = partitions()


def global_name(chunk: torch.nn.Module, name: str) -> str:
    """A pipeline stage's parameter name as the whole model (one stage) names it: decoder
    layers by their global number (megatron's `layer_number`, 1-based, counts from the
    stage's offset), the last stage's copy of a tied embedding as the embedding. At one
    stage, `name` itself."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
    name = ".".join(parts)
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return name


def partition_of(name: str) -> Partition:
    """(dim, stride) of a megatron parameter name, None if replicated."""
    for suffix, partition in PARTITIONS.items():
        if name.endswith(suffix):
            return partition
    return None


def partition_of_param(param: torch.Tensor) -> Partition:
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return param.partition_dim, getattr(param, "partition_stride", 1)


def split(full: torch.Tensor, partition: Partition, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s shard of `full`."""
    if partition is None or world == 1:
        return full
    dim, stride = partition
    chunk = full.shape[dim] // (world * stride)
    return torch.cat(torch.split(full, chunk, dim=dim)[rank::world], dim=dim).contiguous()


def merge(shards: list[torch.Tensor], partition: Partition) -> torch.Tensor:
    """The full tensor from every rank's shard (inverse of `split`)."""
    if partition is None or len(shards) == 1:
        return shards[0]
    dim, stride = partition
    chunks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([chunks[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def gather_full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (TP 1 layout) float32 state of a tensor-parallel model, on every rank."""
    from megatron.core import parallel_state

    from .. import collectives

    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in model.named_parameters():
        data = param.detach().float().contiguous()
        partition = partition_of_param(param)
        if world == 1 or partition is None:
            out[name] = data.cpu()
            continue
        out[name] = merge(collectives.all_gather(data, group=group), partition).cpu()
    return out
