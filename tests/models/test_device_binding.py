"""Which GPU a rank binds, and that DeepSpeed binds the same one.

DeepSpeed binds `cuda:LOCAL_RANK` (deepspeed/comm/torch.py's `device_id`, the engine's
`_set_distributed_vars`, ZeRO 3's `Init`). Under `srun --gpus-per-task=1` each task sees its
one GPU as device 0 while SLURM_LOCALID runs 0..7: before, every task of local rank >= 1 bound
cuda:LOCAL_RANK in DeepSpeed, a device it does not see (`test_deepspeed_binds_the_device_
the_rank_is_on` failed on the old code: DeepSpeed would bind cuda:3, the rank was on 0).
"""

from __future__ import annotations

import os

import pytest
import torch

from del_megatron.errors import UserError
from del_megatron.parallel import local_device_index

SLURM_TASK = {"SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3"}


@pytest.mark.parametrize(
    ("env", "devices", "index"),
    [
        # torchrun: every rank sees the node's GPUs
        ({"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}, 8, 5),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 1, 0),
        # srun --gpus-per-task=1: the task's one GPU is device 0 (CUDA_VISIBLE_DEVICES=0, or
        # the physical id without cgroup device constraint)
        ({**SLURM_TASK, "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0"}, 1, 0),
        ({**SLURM_TASK, "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}, 1, 0),
        # srun with whole-node visibility (--gpus-per-node=8, no binding)
        ({**SLURM_TASK, "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, 8, 3),
        # before rank_environment has copied SLURM_LOCALID
        (SLURM_TASK, 8, 3),
        ({}, 1, 0),  # one process alone
    ],
)
def test_device_index(env, devices, index):
    assert local_device_index(env, devices) == index


@pytest.mark.parametrize(
    ("env", "devices"),
    [
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 1),  # torchrun: two ranks on one GPU
        ({**SLURM_TASK, "LOCAL_RANK": "3"}, 2),  # a task bound to two GPUs: which one?
        ({"LOCAL_RANK": "0"}, 0),
    ],
)
def test_ambiguous_or_shared_devices_are_one_line(env, devices):
    with pytest.raises(UserError) as err:
        local_device_index(env, devices)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("visible", [1, 8])
def test_deepspeed_binds_the_device_the_rank_is_on(monkeypatch, visible):
    """parallel.init_distributed as a SLURM task of local rank 3 runs it: the device it sets
    and the LOCAL_RANK DeepSpeed reads afterwards agree, whatever the task sees."""
    import torch.distributed as dist

    from del_megatron import parallel

    bound = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the group itself: not here
    monkeypatch.setattr(dist, "get_rank", lambda: 11)
    monkeypatch.setattr(dist, "get_world_size", lambda: 16)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        # set first, so that monkeypatch restores them (absent) after the test: init_distributed
        # writes them into os.environ itself, and a RANK or WORLD_SIZE left behind reaches every
        # later test's subprocesses (SLURM jobs, torchrun, the README example)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in {**SLURM_TASK, "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    parallel.init_distributed(torch.device("cuda"), timeout_minutes=60)
    deepspeed_device = int(os.environ["LOCAL_RANK"])  # deepspeed/comm/utils.py reads this
    assert bound == [deepspeed_device] == [0 if visible == 1 else 3]
    # the rank that prints once a node is still found by SLURM's local id
    from del_megatron.cli.train import _node_leader

    assert not _node_leader()
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert _node_leader()
