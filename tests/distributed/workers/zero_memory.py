"""torchrun worker: what DeepSpeed's engine holds at each ZeRO stage, counted tensor by tensor.

The engine of a small bf16 model (torch modules: parameters above and below ZeRO 3's
persistence threshold) under the run's own DeepSpeed config for a GPU run
(`config.deepspeed_config(gpu=True)`: bf16, gradients summed and reduced in float32), two
micro-batches a step, on 2 data-parallel ranks (gloo, DeepSpeed's CPU accelerator), with
small buckets so that every part of the plan shows. Two steps, then the third's micro-batches;
the storages of every live tensor (gc) but those alive before the engine was made are summed
at two points: during the last backward
(the largest of the snapshots taken as each layer's output gradient arrives: DeepSpeed's
buckets and gathered parameters exist then) and at the accumulation boundary after it (the
model states, before the step).

argv: the sizes of zero_optimization as JSON. Prints on rank 0 one JSON line per stage:
{"stage", "optimizer", "tensors": [numel...], "largest", "boundary", "peak"} (bytes).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from del_megatron.config import parse_run_config
from del_megatron.training.engines.deepspeed import deepspeed_config

H = 512


def live_tensors() -> list[torch.Tensor]:
    return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]


def live_bytes(exclude: set[int]) -> int:
    """The bytes of the storages of every live tensor, but those at the addresses `exclude`."""
    storages = {}
    for tensor in live_tensors():
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_config(stage: int):
    return parse_run_config(
        {
            "model": {  # unused: the engine's model is the one above; only the batch counts
                "vocab_size": 64,
                "hidden_size": 64,
                "ffn_hidden_size": 64,
                "num_layers": 1,
                "num_attention_heads": 1,
                "num_query_groups": 1,
                "max_position_embeddings": 8,
            },
            "parallel": {"zero_stage": stage},
            "train": {"steps": 1, "micro_batch_size": 1, "global_batch_size": 4, "seq_len": 8},
            "data": {"tokenizer": "unused.model", "sources": [{"manifest": "unused.json"}]},
        }
    )


def measure(stage: int, sizes: dict) -> dict:
    import deepspeed

    gc.collect()
    # what was alive before (earlier engines' tensors DeepSpeed's globals still hold), held
    # alive until the end so that no new storage takes one of their addresses
    before = live_tensors()
    baseline = {t.untyped_storage().data_ptr() for t in before}
    torch.manual_seed(0)
    layers = [torch.nn.Linear(H, H, bias=False) for _ in range(4)]
    model = torch.nn.Sequential(*layers, torch.nn.LayerNorm(H), torch.nn.Linear(H, 3 * H))
    model = model.bfloat16()
    tensors = [p.numel() for p in model.parameters()]
    config = deepspeed_config(run_config(stage), dist.get_world_size(), gpu=True)
    config["zero_optimization"].update(sizes)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(dist.get_rank())).bfloat16()
    x.requires_grad_()
    snapshots, watching = [], [False]

    def snapshot(grad):
        if watching[0]:
            # what is reachable: garbage in reference cycles that the collector has not yet
            # reached (when it runs depends on allocation counts) was once counted too
            gc.collect()
            mine = {x.untyped_storage().data_ptr(), grad.untyped_storage().data_ptr()}
            snapshots.append(live_bytes(baseline | mine))

    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(lambda _m, _i, out: out.register_hook(snapshot) and None)
    for step in range(3):
        for micro in range(2):
            watching[0] = step == 2 and micro == 1
            engine.backward(engine(x).float().pow(2).mean())
            if watching[0]:
                watching[0] = False
                gc.collect()
                boundary = live_bytes(baseline | {x.untyped_storage().data_ptr()})
            engine.step()
    result = {
        "stage": stage,
        "optimizer": type(engine.optimizer).__name__,
        "tensors": tensors,
        "largest": max(tensors),
        "boundary": boundary,
        "peak": max(snapshots),
    }
    engine.destroy()
    del before
    return result


def main() -> None:
    # DeepSpeed's CPU accelerator, as runtime.select_accelerator sets it (not imported
    # here: it imports megatron-core, a quarter of this worker's time on two cores)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    sizes = json.loads(sys.argv[1])
    for stage in (1, 2, 3):
        result = measure(stage, sizes)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    # before exit, as parallel.end_distributed does (not imported: megatron-core): a gloo
    # group alive then, or a worker thread of one still freeing a work, can abort the
    # process as the interpreter ends; CI saw rank 0 end so, in SIGABRT, twice
    dist.destroy_process_group()
    time.sleep(0.2)  # parallel.GLOO_SETTLE_S


if __name__ == "__main__":
    main()
