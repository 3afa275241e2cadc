"""torchrun worker (one process): the weight decay each engine applies to each parameter.

    weight_decay.py TOKENIZER MANIFEST ENGINE...

For each engine, workers/megatron_engine.py's model (biases and norm weights present) with
optim.weight_decay=0.1; prints `DECAY <engine> <json {name: weight decay}>`, read from the
optimizer's own parameter groups (what its step applies), and `LR <engine> <json {name:
learning rate}>` after one schedule step."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from del_megatron.parallel import end_distributed
from del_megatron.training.trainer import setup
from tests.distributed.workers.megatron_engine import tree


def named_groups(run) -> list[tuple[list[str], dict]]:
    """(parameter names, the torch optimizer's group) of each group the step applies."""
    from del_megatron.models.sharding import global_name

    if run.cfg.train.engine == "megatron":
        names = {
            id(p): global_name(m, n) for m in run.engine.modules for n, p in m.named_parameters()
        }
        inner = getattr(run.engine.optimizer, "chained_optimizers", [run.engine.optimizer])
        return [
            ([names[id(p)] for p in group["params"]], group)
            for optimizer in inner
            for group in optimizer.optimizer.param_groups
        ]
    names = {id(p): n for n, p in run.engine.module.named_parameters()}
    zero = run.engine.optimizer
    return [
        ([names[id(p)] for p in params], zero.optimizer.param_groups[i])
        for i, params in enumerate(zero.bit16_groups)
    ]


def main() -> None:
    from del_megatron.config import parse_run_config

    tokenizer, manifest, *engines = sys.argv[1:]
    for engine in engines:
        config = tree(tokenizer, manifest, f"{engine}:1:1/del", None)
        config["optim"]["weight_decay"] = 0.1
        run = setup(parse_run_config(config))
        groups = named_groups(run)
        decay = {name: group["weight_decay"] for names, group in groups for name in names}
        run.scheduler.step()
        lr = {name: group["lr"] for names, group in groups for name in names}
        if dist.get_rank() == 0:
            print(f"DECAY {engine} {json.dumps(decay)}", flush=True)
            print(f"LR {engine} {json.dumps(lr)}", flush=True)
        if engine == "deepspeed":
            run.engine.destroy()
    end_distributed()


if __name__ == "__main__":
    main()
