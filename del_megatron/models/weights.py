"""Initial weights into a built (tensor-parallel) model, each rank reading only its shard.

Host memory per rank: the model's own parameters plus one tensor slice in flight, whatever
the checkpoint's size (docs/benchmarks.md measures it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .architecture import LlamaArchitecture
from .hf_config import ConversionError
from .hf_tensors import canonical, check_hf_tensors, rank_shard
from .sharding import global_name
from .weight_files import HFCheckpoint, MegatronWeights

ShardSource = Callable[[str], torch.Tensor]  # canonical name -> this rank's shard


def copy_in(model: torch.nn.Module, shard_of: ShardSource) -> None:
    """Every parameter of `model` (a pipeline stage's chunk or the whole model) from
    `shard_of` its canonical global name, checked against the parameter's shape."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            # a pipeline stage's layers by their number in the whole model
            shard = shard_of(canonical(global_name(model, name)))
            if tuple(shard.shape) != tuple(param.shape):
                raise ConversionError(
                    f"{name}: checkpoint shard {tuple(shard.shape)} does not fit the model's "
                    f"{tuple(param.shape)} (another architecture?)"
                )
            param.copy_(shard)


def _tensor_parallel() -> tuple[int, int]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def load_hf(model: torch.nn.Module, checkpoint: HFCheckpoint, arch: LlamaArchitecture) -> None:
    """This rank's slices of every Hugging Face tensor, into the model."""
    check_hf_tensors(checkpoint.shapes, arch)
    rank, world = _tensor_parallel()
    padded = arch.padded_vocab_size(world)
    copy_in(model, lambda name: rank_shard(checkpoint.read, name, arch, padded, rank, world))


def load_megatron(model: torch.nn.Module, weights: MegatronWeights, padded_vocab: int) -> None:
    """A del-megatron weights directory of any tensor-parallel size, into the model."""
    rank, world = _tensor_parallel()
    copy_in(model, lambda name: weights.rank_shard(name, rank, world, padded_vocab))
