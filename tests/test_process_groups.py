"""The process groups a run makes: each inherits the run's one backend (NCCL on GPU, gloo on
CPU), the one that takes the run's device tensors, and none is made that the run never uses.

`test_megatron_makes_no_group_of_another_backend` failed on the code before: megatron-core's
`create_gloo_process_groups` was left at its default (True), so every rank made gloo
data-parallel groups at start (`DATA_PARALLEL_GROUP_GLOO`, `..._WITH_CP_GLOO`,
`EXPERT_DATA_PARALLEL_GROUP_GLOO`), each a full mesh over the host name's interface across
nodes, for megatron's own distributed optimizer and checkpointing, which we do not run.
`test_del_evals_groups_take_its_devices_tensors` failed for cuda: del-eval's one-process group
was gloo whatever the device, so its model's CUDA probes met a group that takes CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from del_megatron import collectives, parallel
from tests.utils import end_process_group


def test_del_eval_ends_the_groups_its_evaluation_made(monkeypatch):
    """del-eval's process ends the groups it made before it returns (`cli/groups.py`), as
    del-train's ranks do (tests/training/test_faults.py): a gloo group alive as the
    interpreter ends can turn the exit status into SIGABRT. A caller's groups are its own."""
    from del_megatron.cli import eval as del_eval
    from del_megatron.evaluation import backends

    end_process_group()  # none alive yet: a module before may have left its own

    def evaluation(argv):  # the groups loading a model makes, then an evaluation's status
        backends._single_process_groups(torch.device("cpu"))
        assert dist.is_initialized() and parallel_state.model_parallel_is_initialized()
        return 0

    monkeypatch.setattr(del_eval, "evaluate_main", evaluation)
    argv = ["/some/model", "--gsm8k", "problems.jsonl"]
    assert del_eval.main(argv) == 0
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    backends._single_process_groups(torch.device("cpu"))  # a caller's, made before
    try:
        assert del_eval.main(argv) == 0
        assert dist.is_initialized() and parallel_state.model_parallel_is_initialized()
    finally:
        end_process_group()


def test_megatron_makes_no_group_of_another_backend(group, monkeypatch):
    made = []
    new_group = dist.new_group

    def recorded(*args, **kwargs):
        made.append(kwargs.get("group_desc") or "?")
        if kwargs.get("backend") is not None:
            made[-1] += f" (backend {kwargs['backend']})"
        return new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recorded)
    started = not parallel_state.model_parallel_is_initialized()
    parallel.init_model_parallel(1, timeout_minutes=60)
    try:
        assert made, "megatron made no group: the spy did not see its calls"
        assert [m for m in made if "backend" in m] == []
    finally:
        if started:
            parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_del_evals_groups_take_its_devices_tensors(kind, monkeypatch):
    """The one-process group del-eval makes for a model on `kind` takes `kind` tensors."""
    from del_megatron.evaluation import backends

    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: made.append(backend))
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    backends._single_process_groups(torch.device(kind))
    (backend,) = made
    assert kind in collectives.BACKEND_DEVICES[backend], backend
