"""Process groups: torch.distributed and megatron-core's parallel state, and the adapter
DeepSpeed takes as `mpu` so ZeRO reduces over data-parallel ranks only."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size). torchrun and SLURM set the environment; alone, one process."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"],
            WORLD_SIZE=os.environ["SLURM_NTASKS"],
            LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        )
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(
            dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False
        )
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def init_model_parallel(tensor_parallel: int) -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)


class MegatronMPU:
    """What DeepSpeed asks of `mpu`, from megatron-core's parallel state. Model parallel is
    tensor parallel here (no pipeline); megatron-core 0.16 lacks the get_model_parallel_*
    names DeepSpeed also calls."""

    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(
        parallel_state.get_tensor_model_parallel_world_size
    )
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(
        parallel_state.get_tensor_model_parallel_world_size
    )
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
