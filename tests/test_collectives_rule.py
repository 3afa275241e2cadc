"""Every collective the project issues goes through del_megatron/collectives.py, which checks
that each tensor lives where its group's backend takes it (an AST scan of del_megatron/ and
data_tools/); and the rule itself, in one process."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from del_megatron import collectives

ROOT = Path(__file__).resolve().parents[1]
RULE = ROOT / "del_megatron" / "collectives.py"
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
}
DISTRIBUTED_MODULES = {"torch.distributed", "deepspeed.comm"}


def collective_calls(path: Path) -> list[str]:
    """'file:line name' of each collective called on torch.distributed or deepspeed.comm,
    under whatever name the module was imported."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = set()  # names bound to a distributed module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in DISTRIBUTED_MODULES:
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for a in node.names:
                if f"{module}.{a.name}" in DISTRIBUTED_MODULES:
                    aliases.add(a.asname or a.name)
                elif module in DISTRIBUTED_MODULES and a.name in COLLECTIVES:
                    found.append(f"{path}:{node.lineno} imports {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            if ast.unparse(node.value) in aliases:
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_scan_sees_each_way_of_calling_a_collective(tmp_path):
    code = tmp_path / "example.py"
    code.write_text(
        "import torch\nimport torch.distributed as dist\nimport torch.distributed\n"
        "from torch import distributed as d2\nfrom torch.distributed import barrier\n"
        "dist.all_reduce(t)\ntorch.distributed.broadcast(t, 0)\nd2.all_gather(p, t)\n"
        "dist.get_rank()\n"
    )
    assert len(collective_calls(code)) == 4


def test_no_collective_outside_the_rule():
    files = sorted((ROOT / "del_megatron").rglob("*.py")) + sorted(
        (ROOT / "data_tools").rglob("*.py")
    )
    outside = [c for f in files if f != RULE for c in collective_calls(f)]
    assert outside == [], "collectives outside del_megatron/collectives.py:\n" + "\n".join(outside)


def test_backend_devices(monkeypatch):
    for backend, devices in (
        ("nccl", ("cuda",)),
        ("gloo", ("cpu",)),
        ("cpu:gloo,cuda:nccl", ("cpu", "cuda")),
    ):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collectives.backend_devices(None) == devices


def test_a_host_tensor_on_an_nccl_group_is_refused_before_the_call(monkeypatch):
    """What NCCL would refuse on the first GPU step, refused here with a message naming the
    collective, even in a one-process group where nothing is communicated."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    with pytest.raises(collectives.CollectiveDeviceError, match="all_reduce: a cpu tensor"):
        collectives.all_reduce(torch.zeros(2))
    with pytest.raises(collectives.CollectiveDeviceError, match="all_gather: a cpu tensor"):
        collectives.all_gather(torch.zeros(2))


def test_alone_the_collectives_are_identities():
    t = torch.arange(3.0)
    assert collectives.all_reduce(t) is t
    assert collectives.all_gather(t) == [t]
    assert collectives.all_gather_object({"a": 1}) == [{"a": 1}]
    assert collectives.gather_object({"a": 1}) == [{"a": 1}]
    collectives.barrier()


def test_the_switch_issues_every_collective_on_a_one_rank_group(group, monkeypatch):
    """DEL_COLLECTIVES_ON_ONE_RANK=1 (what the one-GPU acceptance run sets): our collectives
    call torch.distributed on a one-process group too, with the same results; the loss op's
    two all-reduces included. Without it, none is called."""
    from del_megatron import DigitVocab, NumericLossConfig
    from del_megatron.losses import vocab_parallel_numeric_loss

    calls = []
    for name in ("all_reduce", "all_gather", "all_gather_object", "gather_object", "barrier"):
        original = getattr(dist, name)

        def counted(*args, name=name, original=original, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[5], vocab_size=32)
    logits = torch.randn(4, 1, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[11, 3, 12, 5]])

    def issue() -> float:
        t = torch.arange(3.0)
        assert collectives.all_reduce(t, group=group) is t and t.tolist() == [0.0, 1.0, 2.0]
        assert [p.tolist() for p in collectives.all_gather(t, group=group)] == [t.tolist()]
        assert collectives.all_gather_object({"a": 1}, group=group) == [{"a": 1}]
        assert collectives.gather_object({"a": 1}, group=group) == [{"a": 1}]
        collectives.barrier(group=group)
        cfg = NumericLossConfig()
        return vocab_parallel_numeric_loss(logits, labels, vocab, cfg, group=group).loss.item()

    without = issue()
    assert calls == []
    monkeypatch.setenv(collectives.ON_ONE_RANK, "1")
    assert issue() == without
    assert (
        calls
        == ["all_reduce", "all_gather", "all_gather_object", "gather_object", "barrier"]
        + ["all_reduce"] * 2
    )
