"""torchrun worker: one parallel layout of the layout-free checkpoint test.

For each checkpoint directory named in LOAD: load it at this layout (checkpoint/load.py) and
check that the gathered fp32 master weights, both Adam moments and every parameter's Adam
step equal the saved ones bit for bit (the saved state in the TP 1 layout, merged from the
files), that the model's weights equal the masters, and that the schedule is where it was.
Then, with TRAIN=1: train 6 steps from there, save, and check that the files hold exactly
what the optimizer holds (so "the saved state" above is the state that was trained).
Vocabulary tensors are compared on the tokenizer's rows (the state keeps those); their
padding rows must hold zero moments always (no loss reads them) and, after a load at another
layout, zero masters and weights (made at the load).

Bytes are counted on every rank: what the collectives of the layout-free save touch (every
tensor handed to torch.distributed or DeepSpeed's collectives, outputs included) must be
<= 1.1 x the rank's own slice of the state (12 bytes an element of its ZeRO range, tokenizer
rows only), and the checkpoint <= 1.05 x (that state + model/'s weights); what a load
reads of the state's tensors (a counting safetensors reader) must be <= 1.1 x the rank's new
slice, and over all ranks <= 1.1 x the state (so the mean rank reads <= 1.1 x state /
(TP x DP)).

argv: OUT LOAD(comma-separated checkpoint dirs, or -) TRAIN(0|1) config_file override...
Prints one "OK ..." line per check on rank 0.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from del_megatron import collectives
from del_megatron.checkpoint import adapter as engines
from del_megatron.checkpoint import load as loading
from del_megatron.checkpoint import optim_format, optim_state, rng
from del_megatron.checkpoint.layout import Layout
from del_megatron.config import load_run_config
from del_megatron.models.hf_tensors import canonical
from del_megatron.models.sharding import merge, partition_of_param
from del_megatron.training import checkpointing
from del_megatron.training.engines import deepspeed_checkpoint as deepspeed_engine
from del_megatron.training.trainer import setup, train_step


def gathered_tp1(run, param, key: str) -> torch.Tensor:
    """One parameter's `key` as the optimizer holds it, in the TP 1 layout."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from megatron.core import parallel_state

    full = (
        safe_get_full_fp32_param(param)
        if key == "fp32"
        else safe_get_full_optimizer_state(param, key)
    )
    value = full.detach().float().contiguous()  # [tp shard], dp-gathered
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
    params = [p for _, p in engines.trained_parameters(module)]
    out = {}
    with deepspeed.zero.GatheredParameters(params, enabled=run.cfg.parallel.zero_stage == 3):
        for name, param in engines.trained_parameters(module):
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
    if not optim_format.has_vocab_rows(name):
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

    index = optim_format.read_index(path)
    saved = {e["canonical"]: e for e in index["params"]}
    steps = deepspeed_engine.adam_steps(run.engine.optimizer)
    weights = model_weights_tp1(run)
    for name, param in engines.trained_parameters(run.engine.module):
        entry = saved[canonical(name)]
        assert steps[id(param)] == entry["step"], f"{when}: {name} step {steps[id(param)]}"
        for key in optim_format.KEYS:
            full = gathered_tp1(run, param, key)
            if key == "fp32":
                assert torch.equal(weights[name], full), (
                    f"{when}: the model's {name} differs from its fp32 master"
                )
            zero = made_padding or key != "fp32"
            mine = tokenizer_rows(run, name, full, f"{when}: {key}", zero_padding=zero)
            theirs = optim_format.saved_full(path, index, entry, key)
            assert mine.shape == theirs.shape, f"{when}: {name}/{key} {mine.shape}"
            assert torch.equal(mine, theirs), (
                f"{when}: {name}/{key} differs by {(mine - theirs).abs().max().item()}"
            )
    assert run.scheduler.last_epoch == index["scheduler_last_epoch"], when
    saved_buffers = {e["canonical"]: e for e in index["buffers"]}
    for name, buffer in engines.saved_buffers(run.engine.module):
        entry = saved_buffers[canonical(name)]
        value = buffer.detach().float().contiguous()
        if entry["partition"] and run.cfg.parallel.tensor_parallel > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            value = merge(collectives.all_gather(value, group=group), tuple(entry["partition"]))
        expected = optim_format.saved_full(path, index, entry, optim_format.BUFFER)
        value = tokenizer_rows(run, name, value, when, zero_padding=made_padding)
        assert torch.equal(value, expected), f"{when}: buffer {name} differs"
    return len(saved) + len(saved_buffers)


def assert_derived_rng(run, path: Path, step: int) -> None:
    """At other tensor/data-parallel sizes the generator is seeded from (seed, step,
    data-parallel rank), before anything draws from it."""
    saved = Layout.saved(json.loads((path / "meta.json").read_text()))
    wanted = checkpointing.layout(run.cfg, run.world)
    if all(getattr(saved, k) == getattr(wanted, k) for k in ("tensor_parallel", "data_parallel")):
        return
    seed = rng.derived_seed(run.cfg.train.seed, step, run.dp_rank)
    expected = torch.rand(4, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(torch.rand(4), expected), f"{path}: RNG not derived from {seed}"


# torch.distributed's collectives (and the references DeepSpeed's backend keeps of two)
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "broadcast",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "gather",
    "scatter", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
)  # fmt: skip


def tensor_bytes(values) -> int:
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += tensor_bytes(value)
    return total


@contextlib.contextmanager
def counted_collectives(counter: list[int]):
    """Add to counter[0] the bytes of every tensor handed to a collective in the block."""
    from deepspeed.comm import comm as ds_comm
    from torch.distributed import distributed_c10d

    def counting(real):
        def call(*args, **kwargs):
            counter[0] += tensor_bytes([*args, *kwargs.values()])
            return real(*args, **kwargs)

        return call

    patched = [
        (module, name, getattr(module, name))
        for module in (dist, distributed_c10d)
        for name in COLLECTIVES
        if hasattr(module, name)
    ]
    backend = ds_comm.cdb
    for attr in ("all_gather_function", "reduce_scatter_function"):
        if backend is not None and getattr(backend, attr, None) is not None:
            patched.append((backend, attr, getattr(backend, attr)))
    for owner, name, real in patched:
        setattr(owner, name, counting(real))
    try:
        yield
    finally:
        for owner, name, real in patched:
            setattr(owner, name, real)


class CountingHandle:
    """A safetensors handle that adds the bytes of every state tensor (master, moments)
    it returns to counter[0]."""

    def __init__(self, inner, counter: list[int]):
        self.inner, self.counter = inner, counter

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def count(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if name.rsplit("/", 1)[-1] in optim_format.KEYS:
            self.counter[0] += value.numel() * value.element_size()
        return value

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.count(name, self.inner.get_tensor(name))

    def get_slice(self, name: str):
        handle, view = self, self.inner.get_slice(name)

        class Slice:
            def get_shape(self):
                return view.get_shape()

            def __getitem__(self, index):
                return handle.count(name, view[index])

        return Slice()

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def counted_reads(counter: list[int]):
    import safetensors

    real = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: CountingHandle(real(*a, **k), counter)
    try:
        yield
    finally:
        safetensors.safe_open = real


def own_slice_bytes(run) -> int:
    """12 bytes (fp32 master, two moments) an element of this rank's ZeRO ranges of its
    shards, the tokenizer's rows of the vocabulary tensors; replicated parameters on
    tensor-parallel rank 0 (the ranks that keep them)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    total = 0
    for name, param in engines.trained_parameters(run.engine.module):
        span = deepspeed_engine.owned(param)
        if span is None or (partition_of_param(param) is None and tp_rank > 0):
            continue
        shape = deepspeed_engine.full_shape(param)
        if optim_format.has_vocab_rows(name):
            rows = optim_format.stored_rows(run.cfg.model.vocab_size, shape[0], tp_rank)
            shape = (rows, *shape[1:])
        total += 12 * max(0, min(span[1], int(torch.Size(shape).numel())) - span[0])
    return total


def state_bytes(path: Path) -> int:
    """12 bytes an element of the stored state (every saved shard, tokenizer rows only)."""
    index = optim_format.read_index(path)
    total = 0
    for entry in index["params"]:
        ranks = index["tensor_parallel"] if entry["partition"] else 1
        for tp in range(ranks):
            shape = tuple(entry["shape"])
            if entry["vocab_rows"] is not None:
                shape = (optim_format.stored_rows(entry["vocab_rows"], shape[0], tp), *shape[1:])
            total += 12 * int(torch.Size(shape).numel())
    return total


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


def assert_one_copy(path: Path) -> None:
    """The checkpoint holds the optimizer state once: its bytes <= 1.05 x (the state's 12
    bytes an element + model/'s weights)."""
    files = [p for p in path.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    weights = sum(p.stat().st_size for p in files if p.parent.name == "model")
    ratio = total / (state_bytes(path) + weights)
    assert ratio <= 1.05, f"{path}: {total} bytes, {ratio:.3f} x state + weights"
    print(f"OK one copy: {total} bytes, {ratio:.4f} x (12 bytes an element + model/)")


def assert_reads_are_slices(run, path: Path, read: int) -> None:
    """Where the load read the layout-free state (at another layout, or at the saved one
    without DeepSpeed's), this rank read <= 1.1 x its new slice of the state's tensors, all
    ranks together <= 1.1 x the state."""
    saved = Layout.saved(json.loads((path / "meta.json").read_text()))
    if not loading.reads_layout_free(path, saved, checkpointing.layout(run.cfg, run.world)):
        return
    mine, state = own_slice_bytes(run), state_bytes(path)
    assert read <= 1.1 * mine, f"rank {run.rank} read {read} bytes of {path}, its slice {mine}"
    reads = collectives.all_gather_object(read)
    assert sum(reads) <= 1.1 * state, f"{path}: {sum(reads)} bytes read of a {state}-byte state"
    if run.is_main:
        share = max(reads) * run.world / state
        print(
            f"OK reads of {path.parent.parent.name}: {sum(reads) / state:.3f} x the state in "
            f"all, the most a rank read {share:.3f} x state / (TP x DP)"
        )


def main() -> None:
    out, load, train, config, *overrides = sys.argv[1:]
    cfg = load_run_config(config, [*overrides, f"output_dir={out}"])
    started = time.perf_counter()
    run = setup(cfg)
    timings = [f"setup {time.perf_counter() - started:.1f}s"]
    layout = checkpointing.layout(cfg, run.world).describe()
    step, made_padding = 0, False
    for path in [Path(p) for p in load.split(",") if p != "-"]:
        started = time.perf_counter()
        read = [0]
        with counted_reads(read):
            step = checkpointing.load(run, path, None)
        timings.append(f"load {time.perf_counter() - started:.2f}s")
        assert_reads_are_slices(run, path, read[0])
        assert_derived_rng(run, path, step)
        saved_layout = Layout.saved(json.loads((path / "meta.json").read_text()))
        made_padding = checkpointing.layout(cfg, run.world).differs_from(saved_layout)
        when = f"{path} loaded at {layout}"
        count = assert_state_equals_files(run, path, when, made_padding=made_padding)
        if run.is_main:
            print(f"OK {path.parent.parent.name} step {step}: {count} tensors equal at {layout}")
    if train == "1":
        for s in range(step + 1, step + 7):
            train_step(run, random_batches(run, s), s)
        started = time.perf_counter()
        sent = [0]
        real_save = optim_state.save_job

        def counted_save(*args, **kwargs):
            with counted_collectives(sent):
                return real_save(*args, **kwargs)

        optim_state.save_job = counted_save
        try:
            pending = checkpointing.save(run, step + 6, None, keep=0)
            saved = checkpointing.publish(run, pending)
        finally:
            optim_state.save_job = real_save
        timings.append(f"save {time.perf_counter() - started:.2f}s")
        mine = own_slice_bytes(run)
        assert sent[0] <= 1.1 * mine, (
            f"rank {run.rank}: the layout-free save's collectives moved {sent[0]} bytes, its "
            f"slice is {mine}"
        )
        most = max(collectives.all_gather_object((sent[0] / mine, sent[0])))
        if run.is_main:
            print(
                f"OK save collectives <= {most[0]:.5f} x the rank's slice ({most[1]} bytes) "
                f"at {layout}"
            )
            assert_one_copy(saved)
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
