"""The layout-free optimizer state of a checkpoint: per parameter, the fp32 master weight and
both Adam moments in the tensor-parallel rank's full (ZeRO-unpartitioned) shape, and Adam's
step count, so that a run at any (tensor parallel, data parallel, ZeRO stage 1/2/3,
accumulation) layout can load it (format: docs/checkpoints.md, "Layout-free state").

```
optim/index.json                  the saved layout, every parameter's name, tensor-parallel
                                  partition (dim, stride), Adam step and writing file; the
                                  LR schedule's position and the engine's step counters
optim/tpNN-dpMM.safetensors       float32 "<param>/fp32", "<param>/exp_avg",
                                  "<param>/exp_avg_sq" of the parameters that data-parallel
                                  rank MM of tensor-parallel rank NN wrote (every dp-th one)
```

The vocabulary's tensors (embedding, output layer, EMO's cost embedding) are padded to a
multiple of make_vocab_size_divisible_by x tensor parallel, a number of rows that differs
between layouts: the state keeps only the tokenizer's rows (the model's vocab_size), so what
is stored is the same whatever the layout, and a load makes the padding rows again, zero.

Saving gathers one parameter at a time over the data-parallel group with DeepSpeed's
`safe_get_full_*` API (ZeRO 1, 2 and 3 alike) and streams it into the owner's file, whose
header is known in advance: no rank holds more than its ZeRO shard plus one parameter, and the
data-parallel ranks of a tensor-parallel rank write their files in parallel. Loading reads,
per parameter, the saved tensor-parallel shards (memory-mapped), merges them to the TP 1
layout, splits out this rank's shard (models/sharding.py) and hands it to `safe_set_full_*`,
which keeps this rank's ZeRO partition of it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..checksums import HashingWriter
from ..errors import UserError, one_line
from ..models.hf_names import padded_names
from ..models.hf_tensors import canonical
from ..models.sharding import merge, partition_of_param

OPTIM = "optim"
INDEX = "index.json"
FORMAT = 2
# format 1 (before 2026-12-01) kept the vocabulary's padding rows too: the same rows are read
READS = (1, FORMAT)
KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # "fp32": the master weight


class LayoutFreeError(UserError, RuntimeError):
    """A layout-free state that cannot be loaded into this run; the message names it."""


def file_name(tp_rank: int, dp_rank: int) -> str:
    return f"tp{tp_rank:02d}-dp{dp_rank:02d}.safetensors"


def writer_of(index: int, dp_size: int) -> int:
    """The data-parallel rank that writes parameter number `index` (round robin, so every
    data-parallel rank writes about 1/dp of the bytes, in parallel)."""
    return index % dp_size


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The tensor-parallel rank's shape of a parameter (ZeRO-3 parameters are empty
    placeholders outside a gather and carry their shape in `ds_shape`)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def trained_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


# (partition dim, stride) of our tensor-parallel buffers by name suffix: EMO's cost embedding
# holds this rank's rows of the output layer [V/tp, h]. Other buffers are replicated (a
# sharded one missing here fails the shape check at another tensor-parallel size).
BUFFER_PARTITIONS = {"emo_cost_embedding": (0, 1)}
BUFFER = "buffer"


def saved_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint keeps (persistent ones: they are in the state dict)."""
    persistent = set(module.state_dict(keep_vars=True))
    return [(name, b) for name, b in module.named_buffers() if name in persistent]


def buffer_partition(name: str):
    for suffix, partition in BUFFER_PARTITIONS.items():
        if name.endswith(suffix):
            return partition
    return None


# Tensors whose rows are the vocabulary padded for tensor parallelism: the parameters
# models/hf_names.py marks padded, and EMO's cost embedding, made from the output layer.
VOCAB_TENSORS = (*padded_names(), "emo_cost_embedding")


def has_vocab_rows(name: str) -> bool:
    return canonical(name).endswith(VOCAB_TENSORS)


def stored_rows(vocab: int, rows: int, rank: int) -> int:
    """How many of tensor-parallel rank `rank`'s `rows` vocabulary rows (its shard of the
    padded vocabulary, rows rank * rows on) are the tokenizer's `vocab`: the ones the state
    keeps (0 for a shard of padding only). Over the ranks they make [vocab, ...], whatever the
    tensor-parallel size and padding."""
    return max(0, min(rows, vocab - rank * rows))


def _stored_shape(name: str, shape: tuple[int, ...], vocab: int, tp_rank: int):
    """The shape a rank's shard of `name` is stored in: its tokenizer's rows of a vocabulary
    tensor, the whole shard of any other."""
    if not has_vocab_rows(name):
        return shape
    return (stored_rows(vocab, shape[0], tp_rank), *shape[1:])


# ---- the ZeRO optimizers' flat groups -------------------------------------------------


def _flat_groups(zero: Any) -> list[tuple[list[torch.nn.Parameter], torch.Tensor]]:
    """(the parameters, the flat fp32 partition Adam steps) of each group of a ZeRO optimizer:
    stage 1/2 name them bit16_groups / single_partition_of_fp32_groups, stage 3 fp16_groups /
    fp32_partitioned_groups_flat, and DeepSpeed's BF16_Optimizer (stage 1 of a bf16 run that
    sums gradients in float32, config.deepspeed_config) bf16_groups /
    fp32_groups_flat_partition."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return list(zip(zero.fp16_groups, zero.fp32_partitioned_groups_flat, strict=True))
    if hasattr(zero, "fp32_groups_flat_partition"):
        return list(zip(zero.bf16_groups, zero.fp32_groups_flat_partition, strict=True))
    return list(zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True))


def adam_steps(zero: Any) -> dict[int, int]:
    """id(parameter) -> Adam's step count for its group (0 before the first step)."""
    steps = {}
    for params, flat in _flat_groups(zero):
        step = zero.optimizer.state.get(flat, {}).get("step", 0)
        for p in params:
            steps[id(p)] = int(step)
    return steps


def ensure_adam_state(zero: Any) -> None:
    """Give every group Adam's state as torch's AdamW creates it lazily at the first step (a
    fresh engine, or one whose steps so far were all skipped as non-finite, has none, and
    DeepSpeed's getters and setters read and write into it), then link each ZeRO 1/2
    parameter's fragments of the moments.

    The link is made every time: DeepSpeed 0.19.8's ZeRO 1/2 `load_checkpoint` rebuilds the
    parameters' fragment mappings without their moments and keeps its flag saying they are
    linked, so after a same-layout resume `safe_get_full_optimizer_state` fails until this."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for params, flat in _flat_groups(zero):
        state = zero.optimizer.state[flat]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        if not hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO 3 reads the state itself
            lazy_init_hp_params_optimizer_state(params, flat, zero.optimizer.state)
    if hasattr(zero, "_hp_optimizer_states_linked"):
        zero._hp_optimizer_states_linked = True


def _set_adam_step(zero: Any, step: int) -> None:
    state = zero.optimizer.state
    for _, flat in _flat_groups(zero):
        if isinstance(state[flat]["step"], torch.Tensor):
            state[flat]["step"].fill_(step)
        else:
            state[flat]["step"] = step


def _model_weights_from_masters(zero: Any) -> None:
    """Copy the fp32 masters into the model's (training dtype) weights, as DeepSpeed does
    after a step: ZeRO 1/2 copy each partition and all-gather; ZeRO 3 copies each rank's
    partition (the model gathers it when it runs)."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        for lp_flat, fp32_flat in zip(
            zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat, strict=True
        ):
            if lp_flat is not None and fp32_flat.numel():
                lp_flat.data.copy_(fp32_flat.data)
    else:
        zero.update_lp_params()


def _get(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    value = (
        safe_get_full_fp32_param(param)
        if key == "fp32"
        else safe_get_full_optimizer_state(param, key)
    )
    if value is None:
        raise RuntimeError(f"DeepSpeed holds no {key} for a parameter (not a ZeRO optimizer?)")
    return value


def _set(param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if key == "fp32":
        safe_set_full_fp32_param(param, value)
    else:
        safe_set_full_optimizer_state(param, value, key)


# ---- a safetensors file written one tensor at a time ---------------------------------


def _header(entries: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The safetensors header of float32 tensors stored back to back in `entries` order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape in entries:
        size = 4 * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(handle, value: torch.Tensor) -> None:
    host = value.detach().to("cpu", torch.float32).contiguous()
    if host.numel():  # a shard of padding only stores no vocabulary rows: no bytes
        handle.write(memoryview(host.numpy()).cast("B"))


# ---- save -------------------------------------------------------------------------------


def save(
    module: torch.nn.Module,
    zero: Any,
    directory: Path,
    *,
    tp_rank: int,
    tp_size: int,
    dp_rank: int,
    dp_size: int,
    vocab_size: int,
    extra: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """Write this rank's part of `directory/optim/`. Every data-parallel rank must call it
    (each gather is a collective of the data-parallel group); data-parallel rank 0 of
    tensor-parallel rank 0 writes the index, with `extra` (schedule, counters) in it.
    `vocab_size`: the model's (unpadded) vocabulary rows, the ones kept of its vocabulary
    tensors. Returns {the file's path under `directory`: its size and SHA-256, hashed as
    written}."""
    out = directory / OPTIM
    out.mkdir(exist_ok=True)
    ensure_adam_state(zero)
    params = trained_parameters(module)
    steps = adam_steps(zero)
    mine = [i for i in range(len(params)) if writer_of(i, dp_size) == dp_rank]
    stored = [_stored_shape(n, full_shape(p), vocab_size, tp_rank) for n, p in params]
    entries = [(f"{params[i][0]}/{key}", stored[i]) for i in mine for key in KEYS]
    # buffers are the same on every data-parallel rank: data-parallel rank 0 writes them
    buffers = [
        (name, b, _stored_shape(name, tuple(b.shape), vocab_size, tp_rank))
        for name, b in (saved_buffers(module) if dp_rank == 0 else [])
    ]
    entries += [(f"{name}/{BUFFER}", shape) for name, _, shape in buffers]
    metadata = {
        "format": str(FORMAT),
        "tensor_parallel_rank": str(tp_rank),
        "steps": json.dumps({params[i][0]: steps[id(params[i][1])] for i in mine}),
    }
    name = file_name(tp_rank, dp_rank)
    with open(out / name, "wb") as raw:
        handle = HashingWriter(raw)  # the checkpoint's files.json: no second read
        handle.write(_header(entries, metadata))
        for i, (_, param) in enumerate(params):
            for key in KEYS:
                value = _get(param, key)  # [full tensor-parallel shard], on every dp rank
                if i in mine:
                    _write_tensor(handle, value.narrow(0, 0, stored[i][0]))
                del value
        for _, buffer, shape in buffers:
            _write_tensor(handle, buffer.narrow(0, 0, shape[0]))
    if tp_rank == 0 and dp_rank == 0:
        index = {
            "format": FORMAT,
            "tensor_parallel": tp_size,
            "data_parallel": dp_size,
            "params": [
                {
                    "name": name,
                    "canonical": canonical(name),
                    "partition": partition_of_param(param),
                    "shape": list(full_shape(param)),  # in the model; stored: `vocab_rows`
                    "vocab_rows": vocab_size if has_vocab_rows(name) else None,
                    "step": steps[id(param)],
                    "writer": writer_of(i, dp_size),
                }
                for i, (name, param) in enumerate(params)
            ],
            "buffers": [
                {
                    "name": name,
                    "canonical": canonical(name),
                    "partition": buffer_partition(name),
                    "shape": list(buffer.shape),
                    "vocab_rows": vocab_size if has_vocab_rows(name) else None,
                    "writer": 0,
                }
                for name, buffer in saved_buffers(module)
            ],
            **extra,
        }
        (out / INDEX).write_text(json.dumps(index, indent=1))
    return {f"{OPTIM}/{name}": handle.entry()}


# ---- load -------------------------------------------------------------------------------


def has_state(checkpoint: Path) -> bool:
    return (checkpoint / OPTIM / INDEX).is_file()


def read_index(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / OPTIM / INDEX
    try:
        index = json.loads(path.read_text())
        if index.get("format") not in READS:
            raise ValueError(f"format {index.get('format')}, this version reads {READS}")
        int(index["tensor_parallel"]), int(index["data_parallel"]), list(index["params"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise LayoutFreeError(f"{path}: unreadable ({one_line(err)[:200]})") from None
    return index


def saved_tensors(
    checkpoint: Path, index: dict[str, Any], entry: dict[str, Any], key: str, tp_ranks: list[int]
) -> Iterator[torch.Tensor]:
    """The saved shards of one parameter's `key` for tensor-parallel ranks `tp_ranks`, read
    memory-mapped from the files that hold them."""
    for tp in tp_ranks:
        yield _read_piece(checkpoint, entry, key, tp, None, None, None)


def saved_full(checkpoint: Path, index: dict[str, Any], entry: dict[str, Any], key: str):
    """One parameter's `key` in the TP 1 layout, merged from the saved shards as stored (a
    vocabulary tensor: [vocab_rows, ...], the tokenizer's rows)."""
    partition = entry["partition"] and tuple(entry["partition"])
    shards = list(
        saved_tensors(checkpoint, index, entry, key, list(range(index["tensor_parallel"])))
    )
    return merge(shards, partition)


def _cover(start: int, stop: int, piece: int) -> list[tuple[int, int, int]]:
    """[(owner, start, stop)] covering [start, stop) of a dim cut into pieces of `piece`
    (owner i holds [i * piece, (i + 1) * piece)), positions within the owner's piece."""
    out = []
    while start < stop:
        owner, offset = divmod(start, piece)
        take = min(piece - offset, stop - start)
        out.append((owner, offset, offset + take))
        start += take
    return out


def slice_plan(
    length: int, stride: int, saved_world: int, rank: int, world: int
) -> list[tuple[int, int, int]]:
    """Which pieces of the saved shards make rank `rank`'s shard at tensor parallel `world`:
    [(saved rank, start, stop)] along the partition dim, in order, for a dim of `length` in
    the TP 1 layout. The TP 1 tensor is `stride` blocks, each the saved ranks' pieces in
    rank order (sharding.merge); the new shard is the TP 1 chunks rank, rank + world, ...
    of length / (world * stride) (sharding.split)."""
    block = length // stride
    saved_piece, new_piece = block // saved_world, block // world
    return [
        (owner, k * saved_piece + start, k * saved_piece + stop)
        for k in range(stride)  # chunk rank + k * world, in the TP 1 layout
        for owner, start, stop in _cover(rank * new_piece, (rank + 1) * new_piece, saved_piece)
    ]


def vocab_plan(vocab: int, saved_rows: int, rows: int, rank: int) -> list[tuple[int, int, int]]:
    """Which rows of the saved shards of a vocabulary tensor (rank r's rows r * saved_rows
    on, `stored_rows` of them stored) make the tokenizer's rows of rank `rank`'s shard of
    `rows` rows: [(saved rank, start, stop)], in order; the shard's rows past them are
    padding."""
    start = rank * rows
    return _cover(start, max(start, min(start + rows, vocab)), saved_rows)


def with_padding(pieces: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """A vocabulary shard of `shape` [rows, ...]: `pieces` (vocab_plan's, in order), then zero
    rows: padding is no token's, so no loss reads it, its gradient is zero and so are its
    moments; its weights are zero as an import from Hugging Face makes them."""
    out = torch.zeros(shape, dtype=torch.float32)
    if pieces:
        real = torch.cat(pieces)
        out[: real.shape[0]] = real
    return out


def _read_piece(
    checkpoint: Path, entry, key: str, owner: int, dim: int | None, start, stop
) -> torch.Tensor:
    """[start, stop) along `dim` of saved rank `owner`'s `key` of one tensor (dim None: all
    of it), read memory-mapped."""
    from safetensors import SafetensorError, safe_open

    path = checkpoint / OPTIM / file_name(owner, entry["writer"])
    try:
        with safe_open(str(path), framework="pt") as handle:
            if dim is None:
                return handle.get_tensor(f"{entry['name']}/{key}")
            view = handle.get_slice(f"{entry['name']}/{key}")
            index_ = [slice(None)] * len(view.get_shape())
            index_[dim] = slice(start, stop)
            return view[tuple(index_)]
    except (SafetensorError, OSError) as err:
        raise LayoutFreeError(f"{path}: unreadable ({one_line(err)[:200]})") from None


def _saved_shard(
    checkpoint, index, entry, key, *, tp_rank: int, tp_size: int, shape, vocab: int | None
) -> torch.Tensor:
    """This tensor-parallel rank's shard of one saved tensor, read memory-mapped: for a
    vocabulary tensor (`vocab` its rows), the tokenizer's rows it holds (`vocab_plan`) and
    padding to `shape`; else its own saved file at the saved tensor-parallel size (or for a
    replicated tensor), or only the pieces of the saved shards that make it (`slice_plan`)."""
    partition = entry["partition"] and tuple(entry["partition"])
    saved_world = index["tensor_parallel"]
    if vocab is not None:
        plan = vocab_plan(vocab, entry["shape"][0], shape[0], tp_rank)
        return with_padding(
            [_read_piece(checkpoint, entry, key, o, 0, a, b) for o, a, b in plan], shape
        )
    if partition is None or saved_world == tp_size:
        own = 0 if partition is None else tp_rank
        return next(saved_tensors(checkpoint, index, entry, key, [own]))
    dim, stride = partition
    length = entry["shape"][dim] * saved_world  # the dim in the TP 1 layout
    return torch.cat(
        [
            _read_piece(checkpoint, entry, key, owner, dim, start, stop)
            for owner, start, stop in slice_plan(length, stride, saved_world, tp_rank, tp_size)
        ],
        dim=dim,
    )


def _vocab_of(checkpoint: Path, entry, name: str, vocab_size: int) -> int | None:
    """The tokenizer's rows of a saved vocabulary tensor (None for other tensors), which
    must be this model's."""
    if not has_vocab_rows(name):
        return None
    saved = entry.get("vocab_rows", vocab_size)  # format 1: not recorded, the arch's (checked)
    if saved != vocab_size:
        raise LayoutFreeError(
            f"{checkpoint / OPTIM}: {name} was saved with {saved} vocabulary rows, "
            f"this model has {vocab_size}"
        )
    return vocab_size


def load(
    module: torch.nn.Module,
    zero: Any,
    checkpoint: Path,
    *,
    tp_rank: int,
    tp_size: int,
    vocab_size: int,
) -> dict[str, Any]:
    """Set every parameter's fp32 master, Adam moments and step from the layout-free state,
    then the model's weights from the masters; returns the index (schedule, counters).
    `vocab_size`: the model's (unpadded) vocabulary rows."""
    index = read_index(checkpoint)
    saved = {entry["canonical"]: entry for entry in index["params"]}
    params = trained_parameters(module)
    names = {canonical(name) for name, _ in params}
    if names != set(saved):
        missing, extra = sorted(names - set(saved)), sorted(set(saved) - names)
        raise LayoutFreeError(
            f"{checkpoint / OPTIM}: parameters differ from this model's "
            f"(missing {missing[:3]}, not in the model {extra[:3]})"
        )
    ensure_adam_state(zero)
    device = _flat_groups(zero)[0][1].device  # where the fp32 partitions live
    steps = set()
    for name, param in params:
        entry = saved[canonical(name)]
        if (entry["partition"] and tuple(entry["partition"])) != partition_of_param(param):
            raise LayoutFreeError(f"{checkpoint / OPTIM}: {name} is partitioned differently")
        shape = full_shape(param)
        vocab = _vocab_of(checkpoint, entry, name, vocab_size)
        for key in KEYS:
            value = _saved_shard(
                checkpoint,
                index,
                entry,
                key,
                tp_rank=tp_rank,
                tp_size=tp_size,
                shape=shape,
                vocab=vocab,
            )
            if tuple(value.shape) != shape:
                raise LayoutFreeError(
                    f"{checkpoint / OPTIM}: {name} has shape {tuple(value.shape)} at tensor "
                    f"parallel {tp_size}, the model {shape}"
                )
            _set(param, key, value.to(device))
        steps.add(int(entry["step"]))
    if len(steps) != 1:
        # the engine steps every group together; different counts are not ours to merge
        raise LayoutFreeError(f"{checkpoint / OPTIM}: Adam step counts differ: {sorted(steps)}")
    _set_adam_step(zero, steps.pop())
    _model_weights_from_masters(zero)
    _load_buffers(
        module, checkpoint, index, tp_rank=tp_rank, tp_size=tp_size, vocab_size=vocab_size
    )
    return index


def _load_buffers(
    module, checkpoint: Path, index, *, tp_rank: int, tp_size: int, vocab_size: int
) -> None:
    """The saved buffers into this rank's module: EMO's cost embedding is made from the
    weights the run started from, which a run at another layout need not make again alike
    (GPU initialization draws each tensor-parallel shard from its own generator)."""
    saved = {entry["canonical"]: entry for entry in index.get("buffers", [])}
    for name, buffer in saved_buffers(module):
        entry = saved.get(canonical(name))
        if entry is None:
            raise LayoutFreeError(f"{checkpoint / OPTIM}: no buffer {name}")
        vocab = _vocab_of(checkpoint, entry, name, vocab_size)
        value = _saved_shard(
            checkpoint,
            index,
            entry,
            BUFFER,
            tp_rank=tp_rank,
            tp_size=tp_size,
            shape=tuple(buffer.shape),
            vocab=vocab,
        )
        if value.shape != buffer.shape:
            raise LayoutFreeError(
                f"{checkpoint / OPTIM}: buffer {name} has shape {tuple(value.shape)} at tensor "
                f"parallel {tp_size}, the model {tuple(buffer.shape)}"
            )
        with torch.no_grad():
            buffer.copy_(value.to(buffer.device, buffer.dtype))
