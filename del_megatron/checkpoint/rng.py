"""Each rank's random generators in a checkpoint (rng/rankNNNNN.pt), and the seed of a
resume at another layout, where no saved generator belongs to the new rank."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generators: torch's, and on GPU the device's and megatron-core's
    tensor-parallel tracker (dropout inside tensor-parallel regions, recomputation)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "cuda": None}
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def derived_seed(seed: int, step: int, dp_rank: int) -> int:
    """The seed of a data-parallel replica resumed at step `step` on a new layout: a pure
    function of the run's seed, the step and the replica's position, so the same resume
    draws the same numbers whatever the saved layout was. Tensor-parallel ranks of one
    replica share it (dropout outside tensor-parallel regions must agree across them);
    megatron's tracker adds the tensor-parallel rank for the regions inside."""
    digest = hashlib.sha256(f"{seed}/{step}/{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: torch.manual_seed takes it


def seed_rng(seed: int, device: torch.device) -> None:
    from ..runtime import seed_rngs

    seed_rngs(seed, cuda_tracker=device.type == "cuda")


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        if state.get("cuda_tracker"):
            tensor_parallel.get_cuda_rng_tracker().set_states(state["cuda_tracker"])
