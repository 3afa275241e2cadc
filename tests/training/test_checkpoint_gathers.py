"""A checkpoint's weights under ZeRO 3 are gathered one parameter at a time: a device holds
its shard of the model plus one whole parameter while data-parallel rank 0 copies it to the
host, never the whole model (a 7B model on every GPU at once). DeepSpeed's
`GatheredParameters` is replaced by a context that counts what is gathered at once.

Fails on the checkpoint code before: one GatheredParameters over every parameter."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from del_megatron.checkpoint import save as saving
from del_megatron.checkpoint.layout import Place
from del_megatron.checkpoint.parts import Record
from del_megatron.training.engines.deepspeed_checkpoint import DeepSpeedAdapter


class Gathers:
    """A stand-in for deepspeed.zero.GatheredParameters that records the most parameters
    gathered at once and each parameter gathered."""

    def __init__(self):
        self.held, self.most, self.gathered = 0, 0, []

    @contextlib.contextmanager
    def __call__(self, params, enabled=True, **kwargs):
        params = list(params) if isinstance(params, (list, tuple)) else [params]
        if enabled:
            self.held += len(params)
            self.most = max(self.most, self.held)
            self.gathered += params
        try:
            yield
        finally:
            if enabled:
                self.held -= len(params)


def test_zero3_weights_are_gathered_one_parameter_at_a_time(tmp_path, monkeypatch):
    import deepspeed
    from megatron.core import parallel_state

    gathers = Gathers()
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", gathers)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    engine = SimpleNamespace(module=module)
    parts = SimpleNamespace(  # data-parallel rank 0 of tensor-parallel rank 0, not rank 0
        place=Place(rank=1, world=2), adapter=DeepSpeedAdapter(engine, zero3=True)
    )
    saving._weights_job(parts, tmp_path, Record())()
    params = list(module.parameters())
    assert gathers.most == 1
    assert [id(p) for p in gathers.gathered] == [id(p) for p in params]
    saved = load_file(str(tmp_path / "model" / "tp00.safetensors"))
    assert saved.keys() == dict(module.named_parameters()).keys()
    for name, param in module.named_parameters():
        assert torch.equal(saved[name], param.detach())
