"""The checkpoint package used on its own, as megatron-core's dist_checkpointing is: a save
and a load handed tensors, a layout and an adapter (checkpoint/parts.py), with no trainer, no
engine of ours, no process group and no megatron parallel state. Fails on the code before:
`save`/`load` took the trainer's run and read megatron's parallel state."""

from __future__ import annotations

import torch
from pydantic import BaseModel

from del_megatron.checkpoint import directory, load, publish, save
from del_megatron.checkpoint.adapter import FP32
from del_megatron.checkpoint.layout import Layout, Place
from del_megatron.checkpoint.parts import Parts, Record

MOMENTS = ("exp_avg", "exp_avg_sq")


class Shape(BaseModel):
    """A model's record for model/arch.json: any pydantic record does."""

    rows: int
    columns: int


class PlainAdamAdapter:
    """checkpoint/adapter.Adapter over one module and torch's AdamW, on one process: the
    parameters are the masters, the whole of each held and written here."""

    pp_rank = None

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def parameters(self):
        return list(self.module.named_parameters())

    def copies(self):
        return []

    def buffers(self):
        return []

    def shard_shape(self, param):
        return tuple(param.shape)

    def owned(self, param):
        return 0, param.numel()

    def writes(self, param):
        return True

    def get(self, param, key):
        return param.data.view(-1) if key == FP32 else self.optimizer.state[param][key].view(-1)

    def put(self, param, key, value):
        self.get(param, key).copy_(value)

    def prepare(self):
        for _, param in self.parameters():
            state = self.optimizer.state[param]
            for key in MOMENTS:
                state.setdefault(key, torch.zeros_like(param))
            state.setdefault("step", torch.tensor(0.0))

    def adam_steps(self):
        return {id(p): int(self.optimizer.state[p]["step"]) for _, p in self.parameters()}

    def set_adam_step(self, step):
        for _, param in self.parameters():
            self.optimizer.state[param]["step"] = torch.tensor(float(step))

    def masters_to_weights(self):
        pass  # the parameters are the masters

    def counters(self, step, samples, skipped):
        return {}

    def set_counters(self, index):
        pass

    def host_weights(self, keep):
        return {n: p.detach().clone() for n, p in self.parameters()} if keep else {}

    def state_bytes(self):
        params = [p for _, p in self.parameters()]
        return sum(p.numel() for p in params), params[0].element_size()


def trained(seed: int, steps: int):
    torch.manual_seed(seed)
    module = torch.nn.Linear(5, 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    for _ in range(steps):
        module(torch.randn(4, 5)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    parts = Parts(
        layout=Layout(engine="plain", tensor_parallel=1, data_parallel=1),
        place=Place(rank=0, world=1),
        adapter=PlainAdamAdapter(module, optimizer),
        scheduler=scheduler,
        device=torch.device("cpu"),
        vocab_size=0,
    )
    return module, optimizer, scheduler, parts


def test_a_save_and_a_load_from_tensors_and_a_layout_alone(tmp_path):
    module, optimizer, scheduler, parts = trained(seed=1, steps=3)
    shape = Shape(rows=3, columns=5)
    record = Record(meta={"tokenizer": "none"}, texts={"note.txt": "hi"}, architecture=shape)
    root = tmp_path / "checkpoints"
    pending = save.save(parts, root, 3, None, record=record, counters={}, keep=1)
    saved = publish.publish(parts.place, pending, run_ends=True)
    assert directory.complete_checkpoints(root) == [saved]
    assert (saved / "note.txt").read_text() == "hi"

    fresh, fresh_optimizer, fresh_scheduler, fresh_parts = trained(seed=2, steps=0)
    step = load.load(
        fresh_parts,
        saved,
        None,
        fingerprint="none",
        architecture=shape.model_dump(mode="json"),
        seed=0,
    )
    assert step == 3
    pairs = zip(module.named_parameters(), fresh.named_parameters(), strict=True)
    for (name, old), (_, new) in pairs:
        assert torch.equal(old, new), name
        for key in MOMENTS:
            assert torch.equal(optimizer.state[old][key], fresh_optimizer.state[new][key]), key
        assert int(fresh_optimizer.state[new]["step"]) == 3
    assert fresh_scheduler.last_epoch == scheduler.last_epoch
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
