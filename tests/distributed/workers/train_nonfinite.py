"""torchrun worker: steps whose loss is NaN are skipped (weights unchanged), counted, and the
run stops with a clear error after train.max_nonfinite_steps of them in a row.

argv: tokenizer manifest zero_stage [megatron]: with `megatron`, train.engine=megatron at
pipeline parallel = the process count (the NaN loss is on the last stage only: the other
stages skip by the agreement; each rank checks its own stage's weights).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from del_megatron.parallel import end_distributed
from del_megatron.training.trainer import NonFiniteError, next_micro_batches, setup, train_step
from tests.distributed.workers.train_equivalence import MICRO, config, global_batches

NAN_STEPS = {1, 2, 4, 5, 6}  # 0-based: two in a row (survived), then three (the limit)


def main() -> None:
    tokenizer, manifest, zero, *engine = sys.argv[1:]
    megatron = engine == ["megatron"]
    cfg = config(tokenizer, manifest, 1, int(zero), "del")
    train = {"steps": 8, "max_nonfinite_steps": 3}
    if megatron:
        train |= {"engine": "megatron", "checkpoints": False}
    pipeline = {"pipeline_parallel": int(os.environ["WORLD_SIZE"]) if megatron else 1}
    cfg = cfg.model_validate(
        {
            **cfg.model_dump(),
            "train": cfg.train.model_copy(update=train).model_dump(),
            "parallel": cfg.parallel.model_copy(update=pipeline).model_dump(),
        }
    )
    run = setup(cfg)
    digit_ids = [ids[0] for ids in run.tokenizer.digit_vocab.digit_ids]
    steps = global_batches(digit_ids) * 2

    def batches(step: int, micro: int):
        window, mask = steps[step]
        rows = slice(micro * MICRO, (micro + 1) * MICRO)
        mask = mask[rows].clone()
        if step in NAN_STEPS:
            mask[0, 0] = float("nan")
        return {"tokens": window[rows, :-1], "labels": window[rows, 1:], "loss_mask": mask}

    import deepspeed

    weights = []
    seen = []
    try:
        for step in range(1, cfg.train.steps + 1):
            outcome = train_step(run, next_micro_batches(run, batches, step - 1), step)
            values = outcome.metrics.values()
            modules = run.engine.modules if megatron else [run.engine.module]
            params = [p for module in modules for p in module.parameters()]
            with deepspeed.zero.GatheredParameters(params, enabled=int(zero) == 3 and not megatron):
                weights.append(torch.cat([p.detach().flatten().clone() for p in params]))
            seen.append(values["skipped_steps"])
    except NonFiniteError as err:
        message = str(err)
    else:
        raise AssertionError("the run did not stop")
    # steps 2, 3 (1-based) were skipped: weights unchanged across them; step 4 trained again
    assert torch.equal(weights[0], weights[1]) and torch.equal(weights[1], weights[2])
    assert not torch.equal(weights[2], weights[3])
    assert seen == [0, 1, 2, 2, 3, 4], seen
    assert "3 optimizer steps in a row (up to step 7)" in message, message
    if dist.get_rank() == 0:
        print("OK", message)


if __name__ == "__main__":
    main()
    end_distributed()  # as del-train ends: a gloo group alive at exit can abort it
