"""A random start that is one model at every layout: each tensor drawn whole from the seed and
its global name, then cut to this rank's shard as a weights directory's tensor is cut.

megatron-core's own random initialization draws from one generator in build order, per rank:
the draws a tensor gets depend on the tensors built before it on that rank (a pipeline stage
builds only its layers), on the vocabulary's padding (832 rows at TP 1, 896 at TP 2 for 800
tokens) and, on GPU, on the tensor-parallel shard drawn: the same seed gave another model at
TP 2 than at TP 1 and at PP 2 than at PP 1, so a comparison of layouts from scratch compared
two models. Here a tensor's draws depend on (seed, global name) only; torchtitan reaches the
same with a seed checkpoint written once and loaded by every layout.

The laws are megatron's (`hf_names.Init`, read from the model's TransformerConfig); the
vocabulary's padding rows are zero, as a loaded checkpoint's are. CPU and CUDA generators
differ, so a random start is one model per device type.
"""

from __future__ import annotations

import hashlib

import torch

from .architecture import LlamaArchitecture
from .hf_names import find
from .sharding import partition_of, split
from .weights import copy_in


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of the tensor `name` (canonical, global) in a run seeded `seed`: a
    stable hash (Python's hash() of a string changes per process), 63 bits, which every
    torch generator takes."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def drawn(
    name: str,
    arch: LlamaArchitecture,
    config,
    seed: int,
    padded_vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """The full (TP 1) float32 canonical tensor `name` of a random start, on `device`: its
    megatron shape ([padded_vocab, h] for the vocabulary's rows, zero past vocab_size;
    [q + 2 kv, h] for the fused QKV, [2 f, h] for fc1's [gate; up]), drawn with megatron's
    law for it (`config`: the model's TransformerConfig). The real rows are one contiguous
    block of the same shape at every padding, so they draw the same numbers."""
    bound = find(name, arch)
    rows = sum(shape[0] for shape in bound.shapes)  # fused parts stack along dim 0
    shape = (padded_vocab if bound.entry.padded else rows, *bound.shapes[0][1:])
    full = torch.zeros(shape, dtype=torch.float32, device=device)
    law = bound.entry.init
    if law == "zeros":
        return full
    if law == "ones":  # megatron's zero-centred norms start at 0 and add 1 in forward
        return full.fill_(0.0 if config.layernorm_zero_centered_gamma else 1.0)
    init = {
        "embedding": config.embedding_init_method,
        "hidden": config.init_method,
        "scaled": config.output_layer_init_method,
    }[law]
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    init(full.narrow(0, 0, rows), generator=generator)  # megatron's: normal_(mean, std)
    return full


def draw_random_start(
    model: torch.nn.Module, arch: LlamaArchitecture, seed: int, padded_vocab: int
) -> None:
    """Every parameter of this rank's model chunk (built with megatron's parallel state, its
    layers numbered globally) from `drawn`: the whole tensor on the parameter's device, then
    this tensor-parallel rank's shard (`sharding.split`, the cut of a weights directory).
    A tied embedding's copy on the last stage is named as the embedding and so draws it.
    Transient memory: one full float32 tensor and its shard."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    device = next(model.parameters()).device
    copy_in(
        model,
        lambda name: split(
            drawn(name, arch, model.config, seed, padded_vocab, device),
            partition_of(name),
            rank,
            world,
        ),
    )
