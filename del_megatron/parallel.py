"""Process groups: torch.distributed and megatron-core's parallel state, and the adapter
DeepSpeed takes as `mpu` so ZeRO reduces over data-parallel ranks only."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .config import ConfigError
from .models.device import bind_local_device, process_group_backend, quiet_communication_setup


def rank_environment() -> None:
    """RANK / WORLD_SIZE / LOCAL_RANK as torch expects them. torchrun sets them; under srun
    (one task per GPU) they come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, and the
    rendezvous address from MASTER_ADDR / MASTER_PORT, which launch/slurm/train.sbatch
    exports. Idempotent; changes nothing outside SLURM."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ.update(
        RANK=os.environ["SLURM_PROCID"],
        WORLD_SIZE=os.environ["SLURM_NTASKS"],
        LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
    )
    if os.environ["WORLD_SIZE"] != "1" and not (
        os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
    ):
        raise ConfigError(
            "running under SLURM with several tasks but MASTER_ADDR / MASTER_PORT are "
            "unset: launch with launch/slurm/train.sbatch or export them"
        )


def init_distributed(device: torch.device, timeout_minutes: float) -> tuple[int, int]:
    """(rank, world size) after joining the process group (see `rank_environment`;
    del_megatron/rendezvous.py: the wait for the other ranks is said, stoppable, and ends
    after the timeout), whose collectives wait `timeout_minutes`
    (parallel.collective_timeout_minutes); alone, one process."""
    rank_environment()
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    # each rank on its own GPU before the process group exists: NCCL's communicators then
    # form on that device, not on device 0 of every rank of the node
    bind_local_device(device, os.environ)
    if not dist.is_initialized():
        import deepspeed

        from . import extension_builds, rendezvous

        extension_builds.install()  # a build killed midway does not block this start
        # every rank said and stoppable while it waits for the others; DeepSpeed's init
        # below wraps the process group made here (device_id: as DeepSpeed binds it on GPU)
        bound = {}
        if device.type == "cuda" and os.environ["WORLD_SIZE"] != "1":
            bound["device_id"] = torch.device("cuda", torch.cuda.current_device())
        rendezvous.join(process_group_backend(device), timedelta(minutes=timeout_minutes), **bound)
        with quiet_communication_setup(device):
            # one backend per run, and every tensor we reduce on the compute device
            # (del_megatron/collectives.py; docs/architecture.md "GPU path")
            deepspeed.init_distributed(
                dist_backend=process_group_backend(device),
                verbose=False,
                timeout=timedelta(minutes=timeout_minutes),
            )
    return dist.get_rank(), dist.get_world_size()


GLOO_SETTLE_S = 0.2  # see end_distributed


def end_distributed() -> None:
    """Destroy this process's groups (megatron's parallel state, DeepSpeed's copy of the world
    group, the default group) before the interpreter exits: a gloo group still alive then
    can abort the process during finalization (its worker threads hold tensors whose release
    needs the interpreter), turning a finished run's exit status into SIGABRT, and NCCL asks
    for it on every exit. Afterwards this process can make fresh groups. Nothing to do where
    none were made. Call it only where no collective is pending (every rank's run ended,
    or an error every rank agreed on)."""
    import sys
    import time

    parallel_state.destroy_model_parallel()
    if "deepspeed.utils.groups" in sys.modules:
        sys.modules["deepspeed.utils.groups"]._WORLD_GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()
        # Destroying is not enough: a gloo worker thread frees each work it ran after the
        # work completed, and needs the interpreter's lock for the tensors' Python objects;
        # one still waiting for it when the interpreter finalizes is ended in a way that
        # aborts the process (pytorch/pytorch#190489; gdb showed ~AsyncAllgatherWork in
        # pt_gloo_runloop). Letting go of the lock a moment lets those threads finish: a
        # ZeRO-3 worker aborted at exit 4 times in 13 without this, 0 in 12 with it.
        time.sleep(GLOO_SETTLE_S)


def init_model_parallel(
    tensor_parallel: int,
    timeout_minutes: float,
    pipeline_parallel: int = 1,
    virtual_pipeline_parallel: int | None = None,
) -> None:
    """megatron-core's groups (tensor, pipeline with its virtual stages, data), their
    collectives waiting `timeout_minutes` as the process group's (megatron's own default is
    30). No gloo groups beside them: megatron makes them
    by default for its own distributed optimizer and checkpointing, which this run does not
    use, and each is a full mesh over the host name's interface at start (the
    GLOO_SOCKET_IFNAME hang of collectives.py's decision)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline_parallel,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=False,
    )


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
