"""torchrun worker: one parallel layout of the layout-free checkpoint test.

For each checkpoint directory named in LOAD: load it at this layout (checkpoint.load) and
check that the gathered fp32 master weights, both Adam moments and every parameter's Adam
step equal the saved ones bit for bit (the saved state in the TP 1 layout, merged from the
files), that the model's weights equal the masters, and that the schedule is where it was.
Then, with TRAIN=1: train 6 steps from there, save, and check that the files hold exactly
what the optimizer holds (so "the saved state" above is the state that was trained).
Vocabulary tensors are compared on the tokenizer's rows (the state keeps those); their
padding rows must hold zero moments always (no loss reads them) and, after a load at another
layout, zero masters and weights (made at the load).

argv: OUT LOAD(comma-separated checkpoint dirs, or -) TRAIN(0|1) config_file override...
Prints one "OK ..." line per check on rank 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from del_megatron import collectives
from del_megatron.config import load_run_config
from del_megatron.models.hf_tensors import canonical
from del_megatron.models.sharding import merge, partition_of_param
from del_megatron.training import checkpoint, layout_free
from del_megatron.training.trainer import setup, train_step


def gathered_tp1(run, param, key: str) -> torch.Tensor:
    """One parameter's `key` as the optimizer holds it, in the TP 1 layout."""
    from megatron.core import parallel_state

    value = layout_free._get(param, key).detach().float().contiguous()  # [tp shard], dp-gathered
    partition = partition_of_param(param)
    if partition is None or run.cfg.parallel.tensor_parallel == 1:
        return value
    group = parallel_state.get_tensor_model_parallel_group()
    return merge(collectives.all_gather(value, group=group), partition)


def model_weights_tp1(run) -> dict[str, torch.Tensor]:
    """The model's own weights (not the masters) in the TP 1 layout."""
    import deepspeed
    from megatron.core import parallel_state

    module = run.engine.module
    params = [p for _, p in layout_free.trained_parameters(module)]
    out = {}
    with deepspeed.zero.GatheredParameters(params, enabled=run.cfg.parallel.zero_stage == 3):
        for name, param in layout_free.trained_parameters(module):
            value, partition = param.detach().float().contiguous(), partition_of_param(param)
            if partition is not None and run.cfg.parallel.tensor_parallel > 1:
                group = parallel_state.get_tensor_model_parallel_group()
                value = merge(collectives.all_gather(value, group=group), partition)
            out[name] = value.clone()
    return out


def tokenizer_rows(run, name: str, value: torch.Tensor, when: str, *, zero_padding: bool):
    """A TP 1 tensor's rows the layout-free state keeps: a vocabulary tensor's first
    vocab_size rows (with `zero_padding`, its padding rows, at the end in the TP 1 layout,
    must be zero), any other tensor whole."""
    if not layout_free.has_vocab_rows(name):
        return value
    vocab = run.cfg.model.vocab_size
    padded = run.cfg.model.padded_vocab_size(run.cfg.parallel.tensor_parallel)
    assert value.shape[0] == padded, f"{when}: {name} has {value.shape[0]} rows, not {padded}"
    assert not (zero_padding and value[vocab:].any()), f"{when}: {name} padding rows not zero"
    return value[:vocab]


def assert_state_equals_files(run, path: Path, when: str, *, made_padding: bool) -> int:
    """The optimizer's state and the model's buffers, gathered to TP 1, equal the
    layout-free files bit for bit on the rows the state keeps. Padding rows of the vocabulary
    tensors: zero moments always, zero masters, weights and buffers where this run made them
    (`made_padding`: loaded at another layout)."""
    from megatron.core import parallel_state

    index = layout_free.read_index(path)
    saved = {e["canonical"]: e for e in index["params"]}
    steps = layout_free.adam_steps(run.engine.optimizer)
    weights = model_weights_tp1(run)
    for name, param in layout_free.trained_parameters(run.engine.module):
        entry = saved[canonical(name)]
        assert steps[id(param)] == entry["step"], f"{when}: {name} step {steps[id(param)]}"
        for key in layout_free.KEYS:
            full = gathered_tp1(run, param, key)
            if key == "fp32":
                assert torch.equal(weights[name], full), (
                    f"{when}: the model's {name} differs from its fp32 master"
                )
            zero = made_padding or key != "fp32"
            mine = tokenizer_rows(run, name, full, f"{when}: {key}", zero_padding=zero)
            theirs = layout_free.saved_full(path, index, entry, key)
            assert mine.shape == theirs.shape, f"{when}: {name}/{key} {mine.shape}"
            assert torch.equal(mine, theirs), (
                f"{when}: {name}/{key} differs by {(mine - theirs).abs().max().item()}"
            )
    assert run.scheduler.last_epoch == index["scheduler_last_epoch"], when
    saved_buffers = {e["canonical"]: e for e in index["buffers"]}
    for name, buffer in layout_free.saved_buffers(run.engine.module):
        entry = saved_buffers[canonical(name)]
        value = buffer.detach().float().contiguous()
        if entry["partition"] and run.cfg.parallel.tensor_parallel > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            value = merge(collectives.all_gather(value, group=group), tuple(entry["partition"]))
        expected = layout_free.saved_full(path, index, entry, layout_free.BUFFER)
        value = tokenizer_rows(run, name, value, when, zero_padding=made_padding)
        assert torch.equal(value, expected), f"{when}: buffer {name} differs"
    return len(saved) + len(saved_buffers)


def assert_derived_rng(run, path: Path, step: int) -> None:
    """At other tensor/data-parallel sizes the generator is seeded from (seed, step,
    data-parallel rank), before anything draws from it."""
    saved = checkpoint.saved_layout(json.loads((path / "meta.json").read_text()))
    wanted = checkpoint.run_layout(run.cfg, run.world)
    if all(saved[k] == wanted[k] for k in ("tensor_parallel", "data_parallel")):
        return
    seed = checkpoint.derived_seed(run.cfg.train.seed, step, run.dp_rank)
    expected = torch.rand(4, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(torch.rand(4), expected), f"{path}: RNG not derived from {seed}"


def random_batches(run, step: int) -> list[dict[str, torch.Tensor]]:
    cfg = run.cfg
    gen = torch.Generator().manual_seed(1000 * step + run.dp_rank)
    out = []
    for _ in range(run.accumulation):
        batch = torch.randint(
            0,
            run.tokenizer.vocab_size,
            (cfg.train.micro_batch_size, cfg.train.seq_len + 1),
            generator=gen,
        )
        out.append(
            {
                "tokens": batch[:, :-1],
                "labels": batch[:, 1:],
                "loss_mask": torch.ones(batch[:, 1:].shape),
            }
        )
    return out


def main() -> None:
    out, load, train, config, *overrides = sys.argv[1:]
    cfg = load_run_config(config, [*overrides, f"output_dir={out}"])
    started = time.perf_counter()
    run = setup(cfg)
    timings = [f"setup {time.perf_counter() - started:.1f}s"]
    layout = checkpoint.describe(checkpoint.run_layout(cfg, run.world))
    step, made_padding = 0, False
    for path in [Path(p) for p in load.split(",") if p != "-"]:
        started = time.perf_counter()
        step = checkpoint.load(run, path, None)
        timings.append(f"load {time.perf_counter() - started:.2f}s")
        assert_derived_rng(run, path, step)
        saved_layout = checkpoint.saved_layout(json.loads((path / "meta.json").read_text()))
        made_padding = checkpoint.changed(saved_layout, checkpoint.run_layout(cfg, run.world))
        when = f"{path} loaded at {layout}"
        count = assert_state_equals_files(run, path, when, made_padding=made_padding)
        if run.is_main:
            print(f"OK {path.parent.parent.name} step {step}: {count} tensors equal at {layout}")
    if train == "1":
        for s in range(step + 1, step + 7):
            train_step(run, random_batches(run, s), s)
        started = time.perf_counter()
        saved = checkpoint.save(run, step + 6, None, keep=0)
        timings.append(f"save {time.perf_counter() - started:.2f}s")
        # padding made at a load stays zero through training: zero gradient, zero decay
        when = f"{saved} as saved at {layout}"
        assert_state_equals_files(run, saved, when, made_padding=made_padding)
        if run.is_main:
            print(f"OK saved step {step + 6} at {layout}")
    if run.is_main:
        print("timings: " + ", ".join(timings))  # for the record, never asserted
    collectives.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
