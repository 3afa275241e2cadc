"""The residency model's rules for copies to the host, the device wait and megatron-core's
reads (tests/distributed/residency.py), each shown on a few tensors: what test_gpu_path.py
relies on when it counts a checkpoint's synchronisations and a megatron step's."""

from __future__ import annotations

import textwrap

import torch

from del_megatron import runtime
from del_megatron.checkpoint import host

from .residency import HOST, MEGATRON, OURS, HostTensor, Pinned, Residency


def run_as(directory: str, source: str, **names):
    """`source` run as code of `directory` (the frames the model judges by their file)."""
    code = compile(textwrap.dedent(source), directory + "_residency_model_test.py", "exec")
    exec(code, names)
    return names


def device_tensors() -> list[torch.Tensor]:
    return [torch.randn(3), torch.randn(2, 2), torch.randn(5, dtype=torch.bfloat16)]


def test_a_blocking_copy_to_the_host_is_a_synchronisation_each():
    mode = Residency()
    with mode:
        got = run_as(
            OURS,
            """
            a = [t.to("cpu", torch.float32, copy=True) for t in tensors]  # the old snapshot
            b = [torch.empty(t.shape, dtype=t.dtype).copy_(t, non_blocking=True) for t in tensors]
            c = [t.to("cpu", non_blocking=True) for t in tensors]  # page-locked by torch
            """,
            torch=torch,
            tensors=device_tensors(),
        )
    assert mode.syncs["setup"] == 6, mode.sync_places  # a and b (pageable), not c
    assert all(type(t) is HostTensor for t in got["a"] + got["b"])
    assert all(type(t) is Pinned for t in got["c"])


def test_host_copies_into_page_locked_memory_wait_once(monkeypatch):
    mode = Residency()
    monkeypatch.setattr(host, "host_buffer", mode.pinned(host.host_buffer))
    monkeypatch.setattr(runtime, "synchronize", mode.waits(runtime.synchronize))
    tensors = device_tensors()
    with mode:
        copies = host.host_copies(tensors)
        masters = host.host_copies(tensors, torch.float32)
        runtime.synchronize(torch.device("cpu"))
    assert [p.split(" at ")[0] for p in mode.sync_places["setup"]] == ["runtime.synchronize"]
    assert all(type(c) is Pinned for c in copies + masters)
    for t, c, m in zip(tensors, copies, masters, strict=True):
        assert c.dtype == t.dtype and torch.equal(c, t) and c.data_ptr() != t.data_ptr()
        assert m.dtype == torch.float32 and torch.equal(m, t.float())


def test_host_copies_into_pageable_memory_wait_once_a_tensor():
    """The same function with a buffer that is not page-locked (no `pinned`)."""
    mode = Residency()
    with mode:
        host.host_copies(device_tensors())
    assert len(mode.sync_places["setup"]) == 3, mode.sync_places


def test_a_host_tensor_is_not_on_the_compute_device():
    mode = Residency()
    with mode:
        got = run_as(OURS, "t = torch.zeros(2)\nd = t.device\nmoved = t.to(d)\n", torch=torch)
    assert got["d"] == HOST and got["d"] != torch.device("cpu")
    assert type(got["moved"]) is HostTensor  # `.to(host.device)`: to the host


def test_megatron_reads_are_counted_in_the_phases_asked_for():
    mode = Residency(library_phases=("train_step",))

    def read(tensor):
        return run_as(MEGATRON, "value = tensor.item()\n", tensor=tensor)["value"]

    step = mode.phased("train_step", read)
    evaluate = mode.phased("evaluate", read)
    with mode:
        step(torch.ones(()))
        evaluate(torch.ones(()))
        read(torch.ones(()))
        run_as(OURS, "tensor.item()\n", tensor=torch.ones(()))  # ours: counted everywhere
    assert dict(mode.syncs) == {"train_step#1": 1, "setup": 1}
