"""The layout-free optimizer state of a checkpoint: per parameter, the fp32 master weight and
both Adam moments of each tensor-parallel shard, written by every data-parallel rank as the
flattened range of the shard its ZeRO partition holds, and Adam's step count, so that a run
at any (tensor parallel, data parallel, ZeRO stage 1/2/3, accumulation) layout can load it
(format: docs/checkpoints.md, "Layout-free state").

```
optim/index.json                  the saved layout; per parameter its name, tensor-parallel
                                  partition (dim, stride), shard shape, tokenizer rows, Adam
                                  step and fragments (tp rank, dp rank, start, stop, file);
                                  the LR schedule's position and the engine's step counters
optim/tpNN-dpMM.safetensors       1-D float32 "<param>/fp32", "<param>/exp_avg",
                                  "<param>/exp_avg_sq": elements [start, stop) of the
                                  flattened shard of tensor-parallel rank NN that
                                  data-parallel rank MM holds; its buffers (dp rank 0)
```

The vocabulary's tensors (embedding, output layer, EMO's cost embedding) are padded to a
multiple of make_vocab_size_divisible_by x tensor parallel, a number of rows that differs
between layouts: the state keeps only the tokenizer's rows (the model's vocab_size), so what
is stored is the same whatever the layout, and a load makes the padding rows again, zero.

Saving copies each rank's own fragments to the host (training/fragments.py: no collective;
one gather of the fragment table for the index), then streams them into its file, behind
training (`save_job`: `snapshot`, then `write_pieces`, which takes host tensors only).
Loading maps this rank's new ZeRO range of its new shard to runs of the saved shards
(`flat_runs`, from `slice_plan` / `vocab_plan`), reads only those byte ranges of the
fragments holding them (memory-mapped) and sets them into the optimizer's own range.
Formats 1 and 2 (one file held each parameter's whole shard) are still read, through
DeepSpeed's `safe_set_full_*`.
"""

from __future__ import annotations

import json
import os
import struct
from bisect import bisect_right
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..checksums import HashingWriter
from ..errors import UserError, one_line
from ..models.hf_names import padded_names
from ..models.hf_tensors import canonical
from ..models.sharding import merge, partition_of_param
from . import fragments

OPTIM = "optim"
INDEX = "index.json"
FORMAT = 3
# format 1 (before 2026-12-01) kept the vocabulary's padding rows too: the same rows are read;
# formats 1 and 2 stored each parameter's whole shard in one writer's file (`_load_shards`)
READS = (1, 2, FORMAT)
KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # "fp32": the master weight


class LayoutFreeError(UserError, RuntimeError):
    """A layout-free state that cannot be loaded into this run; the message names it."""


def file_name(tp_rank: int, dp_rank: int) -> str:
    return f"tp{tp_rank:02d}-dp{dp_rank:02d}.safetensors"


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

# One rank's fragments as host tensors: (parameter name, start, stop, {key: [stop - start]})
Pieces = list[tuple[str, int, int, dict[str, torch.Tensor]]]


def _stored_numel(name: str, shape: tuple[int, ...], vocab: int, tp_rank: int) -> int:
    """Elements of the flattened shard that are stored: a vocabulary tensor's rows are its
    partition dim 0, so its tokenizer rows are a prefix of the flattened shard."""
    return int(torch.Size(_stored_shape(name, shape, vocab, tp_rank)).numel())


def snapshot(module: torch.nn.Module, *, tp_rank: int, vocab_size: int) -> Pieces:
    """This rank's fragments of every trained parameter (`fragments.owned`, cut to the
    stored elements), master and both moments, copied to the host: no collective, and
    nothing the next optimizer step changes (on CPU too, where the optimizer's tensors are
    host tensors already). A replicated parameter is kept by tensor-parallel rank 0's
    data-parallel ranks only (every tensor-parallel rank holds the same)."""
    out: Pieces = []
    for name, param in trained_parameters(module):
        span = fragments.owned(param)
        if span is None or (partition_of_param(param) is None and tp_rank > 0):
            continue
        start = span[0]
        stop = min(span[1], _stored_numel(name, full_shape(param), vocab_size, tp_rank))
        if stop <= start:  # a range of padding rows only
            continue
        values = {
            key: fragments.get(param, key)
            .narrow(0, 0, stop - start)
            .detach()
            .to("cpu", torch.float32, copy=True)
            for key in KEYS
        }
        out.append((name, start, stop, values))
    return out


def write_pieces(
    path: Path,
    pieces: Pieces,
    buffers: list[tuple[str, torch.Tensor]],
    metadata: dict[str, str],
) -> dict[str, Any]:
    """One rank's file: every piece's keys as 1-D float32 tensors "<param>/<key>" (any
    sub-range readable by byte range), then the `buffers` ("<name>/buffer", as shaped),
    streamed and flushed to the disk; returns its size and SHA-256, hashed as written. Host
    tensors in, no collective: the part of a save that runs behind training."""
    entries = [
        (f"{name}/{key}", (stop - start,)) for name, start, stop, _ in pieces for key in KEYS
    ]
    entries += [(f"{name}/{BUFFER}", tuple(b.shape)) for name, b in buffers]
    with open(path, "wb") as raw:
        handle = HashingWriter(raw)  # the checkpoint's files.json: no second read
        handle.write(_header(entries, metadata))
        for _, _, _, values in pieces:
            for key in KEYS:
                _write_tensor(handle, values[key])
        for _, buffer in buffers:
            _write_tensor(handle, buffer)
        raw.flush()
        os.fsync(raw.fileno())  # on the disk before the checkpoint is published
    return handle.entry()


def save_job(
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
) -> Callable[[], dict[str, dict[str, Any]]]:
    """This rank's part of `directory/optim/`, in two halves. Now (every rank must call it):
    a host copy of its own fragments (`snapshot`) and one gather of the fragment table, a few
    bytes a parameter (no full-tensor collective). Returned: the job that writes them, and on
    rank 0 (tensor- and data-parallel rank 0) the index, with `extra` (schedule, counters) in
    it — host data only, no collective, so it can run behind training
    (training/checkpoint_writer.py). `vocab_size`: the model's (unpadded) vocabulary rows,
    the ones kept of its vocabulary tensors. The job returns {each file's path under
    `directory`: its size and SHA-256}, the files flushed to the disk."""
    from .. import collectives
    from .checkpoint_writer import flushed

    out = directory / OPTIM
    out.mkdir(exist_ok=True)
    ensure_adam_state(zero)
    params = trained_parameters(module)
    steps = adam_steps(zero)
    pieces = snapshot(module, tp_rank=tp_rank, vocab_size=vocab_size)
    # buffers are the same on every data-parallel rank: data-parallel rank 0 writes them
    buffers = [
        (
            name,
            b.narrow(0, 0, _stored_shape(name, tuple(b.shape), vocab_size, tp_rank)[0]).to(
                "cpu", copy=True
            ),
        )
        for name, b in (saved_buffers(module) if dp_rank == 0 else [])
    ]
    name = file_name(tp_rank, dp_rank)
    metadata = {"format": str(FORMAT), "tensor_parallel_rank": str(tp_rank)}
    table = [(n, start, stop) for n, start, stop, _ in pieces]
    # to global rank 0 (tensor- and data-parallel rank 0, megatron's order) alone, the index's
    # writer: no rank but it receives the world's tables
    tables = collectives.gather_object((tp_rank, dp_rank, table))
    index = None
    if tables is not None:
        where: dict[str, list[dict[str, Any]]] = {n: [] for n, _ in params}
        for tp, dp, held in tables:
            for n, start, stop in held:
                where[n].append(
                    {"tp": tp, "dp": dp, "start": start, "stop": stop, "file": file_name(tp, dp)}
                )
        index = {
            "format": FORMAT,
            "tensor_parallel": tp_size,
            "data_parallel": dp_size,
            "params": [
                {
                    "name": n,
                    "canonical": canonical(n),
                    "partition": partition_of_param(param),
                    "shape": list(full_shape(param)),  # in the model; stored: `vocab_rows`
                    "vocab_rows": vocab_size if has_vocab_rows(n) else None,
                    "step": steps[id(param)],
                    "fragments": sorted(where[n], key=lambda f: (f["tp"], f["start"])),
                }
                for n, param in params
            ],
            "buffers": [
                {
                    "name": n,
                    "canonical": canonical(n),
                    "partition": buffer_partition(n),
                    "shape": list(buffer.shape),
                    "vocab_rows": vocab_size if has_vocab_rows(n) else None,
                    "writer": 0,
                }
                for n, buffer in saved_buffers(module)
            ],
            **extra,
        }

    def write() -> dict[str, dict[str, Any]]:
        entries = {f"{OPTIM}/{name}": write_pieces(out / name, pieces, buffers, metadata)}
        if index is not None:
            (out / INDEX).write_text(json.dumps(index, indent=1))
            entries.update(flushed(directory, f"{OPTIM}/{INDEX}"))
        return entries

    return write


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
        if index["format"] >= 3:  # every parameter's fragments, which the load maps
            for entry in index["params"]:
                list(entry["fragments"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise LayoutFreeError(f"{path}: unreadable ({one_line(err)[:200]})") from None
    return index


def saved_tensors(
    checkpoint: Path, index: dict[str, Any], entry: dict[str, Any], key: str, tp_ranks: list[int]
) -> Iterator[torch.Tensor]:
    """The saved shards of one parameter's `key` for tensor-parallel ranks `tp_ranks`, as
    stored (a vocabulary tensor: its tokenizer rows), read memory-mapped from the files that
    hold them (format 3: the rank's fragments laid end to end)."""
    if "fragments" not in entry:
        for tp in tp_ranks:
            yield _read_piece(checkpoint, entry, key, tp, None, None, None)
        return
    with OpenFiles(checkpoint) as files:
        for tp in tp_ranks:
            shape = _stored_shape(entry["name"], tuple(entry["shape"]), entry["vocab_rows"], tp)
            numel = int(torch.Size(shape).numel())
            yield _from_fragments(files, entry, key, [(0, tp, 0, numel)], numel).reshape(shape)


def saved_full(checkpoint: Path, index: dict[str, Any], entry: dict[str, Any], key: str):
    """One parameter's `key` in the TP 1 layout, merged from the saved shards as stored (a
    vocabulary tensor: [vocab_rows, ...], the tokenizer's rows)."""
    partition = entry["partition"] and tuple(entry["partition"])
    ranks = range(index["tensor_parallel"] if partition else 1)  # replicated: rank 0's
    return merge(list(saved_tensors(checkpoint, index, entry, key, list(ranks))), partition)


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


class OpenFiles:
    """The optim/ files a load reads, each opened (memory-mapped) once and closed on exit;
    `read` takes a range of a 1-D tensor, reading only its bytes."""

    def __init__(self, checkpoint: Path) -> None:
        self.directory = checkpoint / OPTIM
        self.handles: dict[str, Any] = {}
        self.stack = ExitStack()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def read(self, file: str, tensor: str, start: int, stop: int) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        path = self.directory / file
        try:
            if file not in self.handles:
                self.handles[file] = self.stack.enter_context(safe_open(str(path), framework="pt"))
            return self.handles[file].get_slice(tensor)[start:stop]
        except (SafetensorError, OSError, KeyError) as err:
            raise LayoutFreeError(f"{path}: unreadable ({one_line(err)[:200]})") from None


def flat_runs(
    pieces: list[tuple[int, int, int]],
    shape: tuple[int, ...],
    dim: int,
    saved_length: int,
    start: int,
    stop: int,
) -> list[tuple[int, int, int, int]]:
    """Where [start, stop) of a rank's flattened shard of `shape` lies in the saved shards:
    [(offset in the range, saved rank, saved start, saved stop)] of flat indices, adjacent
    runs merged. `pieces` [(saved rank, first, last)] along `dim` make the shard's positions
    0, 1, ... in order (`slice_plan`, `vocab_plan`; positions past them are padding and in no
    run); a saved shard is `saved_length` long along `dim` and alike elsewhere."""
    inner = int(torch.Size(shape[dim + 1 :]).numel())
    row = shape[dim] * inner  # one index of the dims before `dim`
    runs: list[tuple[int, int, int, int]] = []
    for outer in range(start // row, -(-stop // row)):
        position = 0
        for owner, first, last in pieces:
            lo = (outer * shape[dim] + position) * inner
            hi = lo + (last - first) * inner
            position += last - first
            lo_, hi_ = max(lo, start), min(hi, stop)
            if lo_ >= hi_:
                continue
            source = (outer * saved_length + first) * inner + lo_ - lo
            if runs and runs[-1][1] == owner and runs[-1][3] == source:
                at, _, begin, _ = runs[-1]
                if at + source - begin == lo_ - start:
                    runs[-1] = (at, owner, begin, source + hi_ - lo_)
                    continue
            runs.append((lo_ - start, owner, source, source + hi_ - lo_))
    return runs


def _from_fragments(
    files: OpenFiles, entry, key: str, runs: list[tuple[int, int, int, int]], numel: int
) -> torch.Tensor:
    """A 1-D [numel] float32 tensor, zero but for `runs` (flat_runs'), read from the saved
    fragments that hold them (only their bytes)."""
    out = torch.zeros(numel, dtype=torch.float32)
    held: dict[int, list[dict[str, Any]]] = {}
    for fragment in sorted(entry["fragments"], key=lambda f: f["start"]):
        held.setdefault(fragment["tp"], []).append(fragment)
    starts = {owner: [f["start"] for f in found] for owner, found in held.items()}
    for at, owner, lo, hi in runs:
        found = held.get(owner, [])
        first = max(0, bisect_right(starts.get(owner, []), lo) - 1)
        covered = 0
        for fragment in found[first:]:
            a, b = max(lo, fragment["start"]), min(hi, fragment["stop"])
            if fragment["start"] >= hi:
                break
            if a < b:
                tensor = f"{entry['name']}/{key}"
                piece = files.read(
                    fragment["file"], tensor, a - fragment["start"], b - fragment["start"]
                )
                out[at + a - lo : at + b - lo] = piece
                covered += b - a
        if covered != hi - lo:
            raise LayoutFreeError(
                f"{files.directory}: {entry['name']}/{key}: elements [{lo}, {hi}) of tensor-"
                f"parallel rank {owner}'s shard are in no fragment the index lists"
            )
    return out


def _new_shard(entry, saved_world: int, shape, *, tp_rank: int, tp_size: int, vocab):
    """(dim, pieces along it) that make this rank's shard of `shape` from the saved shards
    (`flat_runs`' arguments), after checking that the saved shape gives the model's."""
    partition = entry["partition"] and tuple(entry["partition"])
    expected = list(entry["shape"])
    if vocab is not None:
        expected[0] = shape[0]  # padded for this size; the tokenizer's rows are read
    elif partition is not None and saved_world != tp_size:
        dim, stride = partition
        length = entry["shape"][dim] * saved_world  # the dim in the TP 1 layout
        expected[dim] = length // tp_size if length % (tp_size * stride) == 0 else -1
    if tuple(expected) != tuple(shape):
        raise LayoutFreeError(
            f"{entry['name']} has shape {tuple(expected)} at tensor parallel {tp_size}, "
            f"the model {tuple(shape)}"
        )
    if vocab is not None:
        return 0, vocab_plan(vocab, entry["shape"][0], shape[0], tp_rank)
    if partition is None:
        return 0, [(0, 0, shape[0])]  # replicated: tensor-parallel rank 0's fragments
    dim, stride = partition
    if saved_world == tp_size:
        return dim, [(tp_rank, 0, shape[dim])]
    return dim, slice_plan(entry["shape"][dim] * saved_world, stride, saved_world, tp_rank, tp_size)


def _load_fragments(
    params, saved, checkpoint: Path, index, *, tp_rank: int, tp_size: int, vocab_size: int
) -> None:
    """Format 3: per parameter, this rank's own ZeRO range (`fragments.owned`) of its new
    shard, mapped to runs of the saved shards (`flat_runs`), read by byte range from the
    fragments holding them and set with no collective (`fragments.put`)."""
    with OpenFiles(checkpoint) as files:
        for name, param in params:
            entry = saved[canonical(name)]
            shape = full_shape(param)
            vocab = _vocab_of(checkpoint, entry, name, vocab_size)
            try:
                dim, pieces = _new_shard(
                    entry,
                    index["tensor_parallel"],
                    shape,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    vocab=vocab,
                )
            except LayoutFreeError as err:
                raise LayoutFreeError(f"{checkpoint / OPTIM}: {err}") from None
            span = fragments.owned(param)
            if span is None:
                continue
            runs = flat_runs(pieces, shape, dim, entry["shape"][dim], *span)
            for key in KEYS:
                value = _from_fragments(files, entry, key, runs, span[1] - span[0])
                fragments.put(param, key, value)


def _load_shards(
    params,
    saved,
    checkpoint: Path,
    index,
    *,
    tp_rank: int,
    tp_size: int,
    vocab_size: int,
    device,
) -> None:
    """Formats 1 and 2: each parameter's saved shards whole, this rank's shard of them
    handed to DeepSpeed's `safe_set_full_*` (which keeps this rank's ZeRO range)."""
    for name, param in params:
        entry = saved[canonical(name)]
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
    for name, param in params:
        partition = saved[canonical(name)]["partition"]
        if (partition and tuple(partition)) != partition_of_param(param):
            raise LayoutFreeError(f"{checkpoint / OPTIM}: {name} is partitioned differently")
    steps = {int(saved[canonical(name)]["step"]) for name, _ in params}
    if len(steps) != 1:
        # the engine steps every group together; different counts are not ours to merge
        raise LayoutFreeError(f"{checkpoint / OPTIM}: Adam step counts differ: {sorted(steps)}")
    ensure_adam_state(zero)
    layout = {"tp_rank": tp_rank, "tp_size": tp_size, "vocab_size": vocab_size}
    if index["format"] >= 3:
        _load_fragments(params, saved, checkpoint, index, **layout)
    else:
        device = _flat_groups(zero)[0][1].device  # where the fp32 partitions live
        _load_shards(params, saved, checkpoint, index, **layout, device=device)
    _set_adam_step(zero, steps.pop())
    _model_weights_from_masters(zero)
    _load_buffers(module, checkpoint, index, **layout)
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
