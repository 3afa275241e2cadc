"""torchrun worker for the warm-rank launcher's own tests (tests/distributed/test_launcher.py).

Modes (argv[1]):
* dirty: leaves behind every kind of state a rank can change in its interpreter (megatron's
  parallel state, torch's default dtype, thread count and seed, the environment, a module
  attribute, an imported module, a warnings filter), as a worker that does not clean up would;
* probe: says, as one JSON line from rank 0, what a fresh rank finds of that state and what it
  computes from a seeded tiny megatron-core model (loss and gradient norm at TP = world size);
* env: the rank's environment names, argv and sys.path[0], as one JSON line per rank;
* leave: ends with its process group alive (what a real interpreter may abort on at exit);
* fail: rank 1 raises while rank 0 waits in a barrier; hang: every rank sleeps.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from megatron.core import parallel_state

import del_megatron
from del_megatron import DigitVocab, NumericLossConfig
from del_megatron.models import LlamaArchitecture, build_llama, loss_func
from del_megatron.parallel import end_distributed

ARCH = LlamaArchitecture(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                         num_attention_heads=4, num_query_groups=2, max_position_embeddings=32)


def dirty() -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.manual_seed(1234)
    os.environ["DEL_WARM_PROBE_LEAK"] = "1"
    del_megatron.warm_probe_leak = True
    sys.modules["warm_probe_leak"] = sys.modules[__name__]
    warnings.simplefilter("error")
    # parallel_state stays initialized: only the default group is ended below


def probe() -> None:
    seeds = [None] * dist.get_world_size()
    dist.all_gather_object(seeds, torch.initial_seed())
    found = {
        "draws_differ": len(set(seeds)) == len(seeds),  # each rank its own seed, as a fresh one
        "parallel_state": parallel_state.model_parallel_is_initialized(),
        "default_dtype": str(torch.get_default_dtype()),
        "threads": torch.get_num_threads(),
        "env": "DEL_WARM_PROBE_LEAK" in os.environ,
        "attribute": hasattr(del_megatron, "warm_probe_leak"),
        "module": "warm_probe_leak" in sys.modules,
        "warnings_error": any(f[0] == "error" for f in warnings.filters),
    }
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    vocab = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=64)
    model = build_llama(ARCH, vocab, NumericLossConfig(kind="del"), torch.device("cpu"), seed=0)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 17), generator=gen)
    mask = torch.ones(2, 16)
    output = model(tokens[:, :-1], torch.arange(16).expand(2, 16), None,
                   labels=tokens[:, 1:], loss_mask=mask)
    loss_sum, count, _ = loss_func(mask, output)
    (loss_sum / count).backward()
    norm_sq = torch.stack([p.grad.double().pow(2).sum() for p in model.parameters()]).sum()
    dist.all_reduce(norm_sq)
    found["loss"] = round((loss_sum / count).item(), 6)
    found["grad_norm_sq"] = round(norm_sq.item(), 6)
    parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        print("PROBE " + json.dumps(found, sort_keys=True), flush=True)


def environment() -> None:
    # as every preloaded module of the warm server: the variables their imports set (DeepSpeed's
    # PYTORCH_NVML_BASED_CUDA_CHECK) are then in both environments
    import deepspeed  # noqa: F401

    print("ENV " + json.dumps({"rank": os.environ["RANK"], "names": sorted(os.environ),
                               "argv": sys.argv, "path0": sys.path[0]}), flush=True)


def main() -> None:
    mode = sys.argv[1]
    if mode == "env":
        environment()
        return
    if mode == "hang":
        time.sleep(3600)
    dist.init_process_group("gloo")
    if mode == "dirty":
        dirty()
    elif mode == "probe":
        probe()
    elif mode == "fail":
        if dist.get_rank() == 1:
            raise ValueError("rank 1 fails on purpose")
        dist.barrier()
    if mode == "leave":
        return
    end_distributed()


if __name__ == "__main__":
    main()
