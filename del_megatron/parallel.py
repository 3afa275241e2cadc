"""A rank's place from its launcher's environment (torchrun's or SLURM's variables: the one
reading of them) and the GPU it takes, process groups (torch.distributed and megatron-core's
parallel state), and the adapter DeepSpeed takes as `mpu` so ZeRO reduces over
data-parallel ranks only.

The environment's part imports nothing heavy (the cache set-up and the console read it
before torch); torch and megatron-core are imported by the functions that make groups."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from datetime import timedelta

from .errors import UserError


def launch_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's global rank as its launcher set it: torchrun's RANK, else SLURM's
    SLURM_PROCID under srun, else 0 (a process started alone)."""
    return int(env.get("RANK", env.get("SLURM_PROCID", "0")))


def local_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK, else SLURM_LOCALID under
    srun, else 0."""
    return int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")))


def first_on_node(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this is the first rank of its node: torchrun's LOCAL_RANK (it sets
    LOCAL_WORLD_SIZE too), else SLURM's task id on the node (under srun, LOCAL_RANK names the
    rank's device once it is bound: `bind_local_device`)."""
    if "LOCAL_WORLD_SIZE" in env or "SLURM_LOCALID" not in env:
        return env.get("LOCAL_RANK", "0") == "0"
    return env["SLURM_LOCALID"] == "0"


def local_device_index(env: Mapping[str, str], device_count: int) -> int:
    """The CUDA device (an index among those this process sees) of this rank.

    env: the process environment (LOCAL_RANK, or SLURM_LOCALID under srun; LOCAL_WORLD_SIZE
    when torchrun started it); device_count: the devices this process sees (after
    CUDA_VISIBLE_DEVICES). Every rank of a node that sees the node's devices (torchrun, srun
    without GPU binding) takes its local rank; a task bound to one GPU (srun
    --gpus-per-task=1, --gpu-bind) sees that GPU alone, as device 0, whatever its local rank.
    Anything else would put two ranks on one device (NCCL refuses it) or leave the choice to
    chance: one line naming what was seen.
    """
    local = local_rank(env)
    if device_count < 1:
        raise UserError("train.device=cuda but this process sees no CUDA device")
    if local < device_count:
        return local
    if device_count == 1 and "LOCAL_WORLD_SIZE" not in env:  # srun's per-task binding
        return 0
    visible = env.get("CUDA_VISIBLE_DEVICES", "unset")
    raise UserError(
        f"local rank {local} but this process sees {device_count} CUDA device(s) "
        f"(CUDA_VISIBLE_DEVICES={visible}): start one rank per GPU (torchrun --nproc_per_node "
        "at most the GPUs, or srun --gpus-per-task=1)"
    )


def bind_local_device(device, env: MutableMapping[str, str]) -> None:
    """Each rank of a node on its own GPU (`local_device_index`), before the process group
    exists. DeepSpeed binds `cuda:LOCAL_RANK` itself (deepspeed/comm/torch.py device_id,
    engine `_set_distributed_vars`, ZeRO 3's `Init`): LOCAL_RANK is set to the same index
    (it differs from the launcher's only under srun, whose SLURM_LOCALID stays)."""
    if device.type != "cuda":
        return
    import torch

    index = local_device_index(env, torch.cuda.device_count())
    env["LOCAL_RANK"] = str(index)
    torch.cuda.set_device(index)


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
        from .config import ConfigError

        raise ConfigError(
            "running under SLURM with several tasks but MASTER_ADDR / MASTER_PORT are "
            "unset: launch with launch/slurm/train.sbatch or export them"
        )


def init_distributed(device, timeout_minutes: float) -> tuple[int, int]:
    """(rank, world size) after joining the process group (see `rank_environment`;
    del_megatron/rendezvous.py: the wait for the other ranks is said, stoppable, and ends
    after the timeout), whose collectives wait `timeout_minutes`
    (parallel.collective_timeout_minutes); alone, one process. device: the run's
    torch.device."""
    import torch
    import torch.distributed as dist

    from .runtime import process_group_backend, quiet_communication_setup

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

    import torch.distributed as dist
    from megatron.core import parallel_state

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
    from megatron.core import parallel_state

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

    def __init__(self) -> None:
        from megatron.core import parallel_state

        self.get_tensor_model_parallel_rank = parallel_state.get_tensor_model_parallel_rank
        self.get_tensor_model_parallel_world_size = (
            parallel_state.get_tensor_model_parallel_world_size
        )
        self.get_tensor_model_parallel_group = parallel_state.get_tensor_model_parallel_group
        self.get_model_parallel_rank = parallel_state.get_tensor_model_parallel_rank
        self.get_model_parallel_world_size = parallel_state.get_tensor_model_parallel_world_size
        self.get_model_parallel_group = parallel_state.get_tensor_model_parallel_group
        self.get_data_parallel_rank = parallel_state.get_data_parallel_rank
        self.get_data_parallel_world_size = parallel_state.get_data_parallel_world_size
        self.get_data_parallel_group = parallel_state.get_data_parallel_group
