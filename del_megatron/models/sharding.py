"""Tensor-parallel sharding of full (TP = 1) megatron-core tensors, from the attributes
megatron-core sets on each parameter (partition_dim, partition_stride)."""

from __future__ import annotations

import torch


def shard_like(full: torch.Tensor, param: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's part of `full` for a parameter laid out like `param`.

    With stride k (SwiGLU's fused gate/up uses 2) the partition dim is cut into k * world
    chunks and rank r takes chunks r, r + world, ...: the same split megatron-core's CPU
    initialization uses, so [gate; up] becomes [gate_r; up_r] on rank r.
    """
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return full
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    chunk = full.shape[dim] // (world * stride)
    return torch.cat(torch.split(full, chunk, dim=dim)[rank::world], dim=dim)
