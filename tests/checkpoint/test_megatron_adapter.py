"""The megatron adapter's Adam step where the optimizer keeps it (training/engines/
megatron_checkpoint.py): torch's Adam and AdamW in each parameter's state (what the CPU suite runs),
the fused Adams megatron picks first on GPU (Transformer Engine's, apex's) in the parameter
group. The fused ones are GPU-only imports: a stand-in keeps the step as their `step()`
does (`group["step"] += 1`, or 1 when absent; moments in the state, no step there).

A resume into a fresh engine runs the adapter's `prepare`, then `set_adam_step`: the next
step must count on from the saved one, and `adam_steps` must read the count the optimizer
uses. Before: `prepare` wrote a step into the state, which a fused Adam never reads, and
`set_adam_step` set the group's only where one existed, so a resume at step 100 took its
first step as step 1 (Adam's bias correction started over on loaded moments) and later
checkpoints recorded 100 forever."""

from __future__ import annotations

import pytest
import torch

from del_megatron.training.engines.megatron_checkpoint import MegatronAdapter, _Holder


class GroupStepAdam(torch.optim.Optimizer):
    """The step bookkeeping of Transformer Engine's and apex's FusedAdam."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})

    def step(self):
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            for param in group["params"]:
                state = self.state[param]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def adapter_over(optimizer, param) -> MegatronAdapter:
    """An adapter whose one parameter is its own master in `optimizer` (no engine needed for
    the step's bookkeeping)."""
    adapter = object.__new__(MegatronAdapter)
    adapter.holders = {id(param): _Holder(optimizer, param, None, None)}
    return adapter


@pytest.mark.parametrize("kind", ["fused", "adamw"])
def test_a_resumed_step_counts_on_from_the_saved_one(kind):
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 0.5)
    optimizer = GroupStepAdam([param]) if kind == "fused" else torch.optim.AdamW([param])
    adapter = adapter_over(optimizer, param)
    adapter.prepare()  # the load: Adam's state made, then its step set
    assert set(optimizer.state[param]) >= {"exp_avg", "exp_avg_sq"}
    assert ("step" in optimizer.state[param]) == (kind == "adamw")
    adapter.set_adam_step(100)
    assert adapter.adam_steps() == {id(param): 100}
    for _ in range(3):
        optimizer.step()
    assert adapter.adam_steps() == {id(param): 103}
    if kind == "fused":
        assert optimizer.param_groups[0]["step"] == 103  # the count its bias correction reads
    else:
        assert optimizer.state[param]["step"].item() == 103
