"""The package works on the oldest versions pyproject admits: a call of an API newer than a
floor fails there (torch 2.4's `gather_object` has no `group_dst`, which came with 2.6: a
cluster on torch 2.4 or 2.5 failed at its first checkpoint). The floor's signature stands in
for the real function, which it calls."""

from __future__ import annotations

import re
import tomllib

import torch.distributed as dist

from del_megatron import collectives

from .distributed.launcher import ROOT


def test_the_torch_floor_is_the_one_these_signatures_are_of():
    needs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_floor = next(d for d in needs if re.match(r"torch\b", d))
    assert torch_floor == "torch>=2.4", torch_floor  # raise it, and the stand-ins below


def test_gather_object_on_torch_2_4s_signature(monkeypatch, tmp_path):
    real = dist.gather_object

    def torch_2_4(obj, object_gather_list=None, dst=0, group=None):  # no group_dst
        return real(obj, object_gather_list, dst=dst, group=group)

    made = not dist.is_initialized()
    if made:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        monkeypatch.setattr(dist, "gather_object", torch_2_4)
        monkeypatch.setenv(collectives.ON_ONE_RANK, "1")  # issued although alone
        group = dist.new_group([0])
        assert collectives.gather_object({"rank": 0}) == [{"rank": 0}]
        assert collectives.gather_object("x", group=group) == ["x"]
    finally:
        if made:
            dist.destroy_process_group()
