"""torchrun worker: 5 optimizer steps of the trainer on fixed global batches, for each of
several variants in one process (each torchrun start costs ~20 s of CI time). A variant is
`KIND[+tokens][+fused[+recompute]]:ZERO[:MICRO]`, e.g. `del+tokens:1:8` or
`del+fused+recompute:3` (`+tokens`: `loss.normalize: tokens`). Rank 0
writes each variant's step losses and gradient norms (before clipping) to OUT_DIR/VARIANT.json
and the full parameters after the last step (gathered across tensor-parallel ranks) beside it
(.pt). The tests compare variants and layouts.

Token counts differ between micro-batches and between data-parallel ranks (each row keeps
between 3% and 100% of its targets): a loss normalised per micro-batch or per rank instead
of over the global batch's tokens shows as another trajectory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from del_megatron.config import parse_run_config
from del_megatron.models.sharding import gather_full
from del_megatron.parallel import end_distributed
from del_megatron.training.trainer import next_micro_batches, setup, train_step

SEQ, MICRO, GLOBAL, VOCAB = 32, 2, 8, 800  # MICRO: unless the variant names one
TIMEOUT_MINUTES = 17  # parallel.collective_timeout_minutes, read back from every group


def config(tokenizer: str, manifest: str, tp: int, zero: int, kind: str, micro: int = MICRO):
    return parse_run_config(
        {
            "model": {
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "ffn_hidden_size": 160,
                "num_layers": 2,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "max_position_embeddings": 64,
                # 800 is a multiple of 16 x TP for TP 1 and 2: one padded size at both (no
                # longer what makes one initial model: models/random_start.py draws one at any)
                "make_vocab_size_divisible_by": 16,
            },
            "loss": {
                "kind": kind.split("+")[0],
                "normalize": "tokens" if "+tokens" in kind else "digits",
                "fused_output": "+fused" in kind,
                "fused_recompute": "+recompute" in kind,
            },
            "parallel": {
                "tensor_parallel": tp,
                "zero_stage": zero,
                "collective_timeout_minutes": TIMEOUT_MINUTES,
            },
            # Adam's eps at 1e-6, not 1e-8: a weight whose gradient is near 1e-8 (the random
            # start has some) gets an update of g / (|g| + eps), which two equal sums apart in
            # their last bits make 2% of a step apart at eps 1e-8 (2.4e-5 after 5 steps
            # against the 2e-5 bound, fused against unfused at ZeRO 3); eps 1e-6 damps only
            # the updates of gradients below about 1e-5
            "optim": {"lr": 1e-3, "warmup_fraction": 0.2, "clip_grad": 1.0, "eps": 1e-6},
            "train": {
                "steps": 5,
                "micro_batch_size": micro,
                "global_batch_size": GLOBAL,
                "seq_len": SEQ,
                "device": "cpu",
                "log_interval": 1,
            },
            "data": {"tokenizer": tokenizer, "sources": [{"manifest": manifest}]},
            "logging": {"wandb": "disabled", "progress_bar": False},
            "output_dir": "/tmp/del-equivalence",
        }
    )


def global_batches(digit_ids: list[int]):
    """Step -> [GLOBAL, SEQ + 1] token windows (40% digits) and a loss mask whose rows keep
    between 3% and 100% of their targets, so micro-batches and ranks differ in tokens."""
    gen = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(5):
        window = torch.randint(3, 700, (GLOBAL, SEQ + 1), generator=gen)
        digits = torch.tensor(digit_ids)[torch.randint(10, window.shape, generator=gen)]
        window = torch.where(torch.rand(window.shape, generator=gen) < 0.4, digits, window)
        keep = torch.empty(GLOBAL, 1).uniform_(0.03, 1.0, generator=gen)
        mask = (torch.rand(GLOBAL, SEQ, generator=gen) < keep).float()
        mask[:, 0] = 1.0  # no row without a target
        steps.append((window, mask))
    return steps


def group_timeouts() -> dict[str, float]:
    """The timeout, in minutes, of the process group and megatron-core's groups, as their
    backends hold it."""
    from megatron.core import parallel_state

    groups = {
        "world": dist.group.WORLD,
        "data": parallel_state.get_data_parallel_group(),
        "tensor": parallel_state.get_tensor_model_parallel_group(),
        "model": parallel_state.get_model_parallel_group(),
    }
    backend = torch.device("cpu")
    return {
        name: group._get_backend(backend).options._timeout.total_seconds() / 60
        for name, group in groups.items()
    }


def run_variant(tokenizer: str, manifest: str, tp: int, variant: str, steps, out_dir: Path):
    kind, zero, *micro = variant.split(":")
    micro = int(micro[0]) if micro else MICRO
    cfg = config(tokenizer, manifest, tp, int(zero), kind, micro)

    def batches(step: int, index: int):
        from megatron.core import parallel_state

        dp = parallel_state.get_data_parallel_world_size()
        block = index * dp + parallel_state.get_data_parallel_rank()
        window, mask = steps[step]
        rows = slice(block * micro, (block + 1) * micro)
        return {"tokens": window[rows, :-1], "labels": window[rows, 1:], "loss_mask": mask[rows]}

    import deepspeed

    run = setup(cfg)
    trajectory = {
        "losses": [],
        "grad_norms": [],
        "flops_per_token": run.flops_per_token,
        "timeout_minutes": group_timeouts(),
    }
    for step in range(1, cfg.train.steps + 1):
        values = train_step(run, next_micro_batches(run, batches, step - 1), step).metrics.values()
        trajectory["losses"].append(values["loss"])
        trajectory["grad_norms"].append(values["grad_norm"])
    module = run.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=int(zero) == 3):
        params = gather_full(module)
    if dist.get_rank() == 0:
        out = out_dir / f"{variant}.json"
        out.write_text(json.dumps(trajectory))
        torch.save(params, str(out) + ".pt")
        print("OK", variant, trajectory, flush=True)
    run.engine.destroy()  # the next variant builds its own model and engine


def main() -> None:
    tokenizer, manifest, tp, out_dir, *variants = sys.argv[1:]
    from del_megatron.tokenizer import Tokenizer

    digit_ids = [ids[0] for ids in Tokenizer(tokenizer).digit_vocab.digit_ids]
    steps = global_batches(digit_ids)
    for variant in variants:
        run_variant(tokenizer, manifest, int(tp), variant, steps, Path(out_dir))


if __name__ == "__main__":
    main()
    end_distributed()  # as del-train ends: a gloo group alive at exit can abort it
