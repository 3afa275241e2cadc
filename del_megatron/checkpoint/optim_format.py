"""The layout-free optimizer state on disk, with no engine in it: per parameter, the fp32
master weight and both Adam moments of each tensor-parallel shard, stored as the flattened
ranges the saving ranks' optimizers held, and Adam's step count, so that a run at any
layout (engine, tensor, pipeline and data parallel, ZeRO stage, accumulation) can load it
(format: docs/checkpoints.md, "Layout-free state"). How an engine's optimizer holds these
ranges is its adapter's (checkpoint/adapter.py); what a rank saves and loads through it is
optim_state.py's.

```
optim/index.json                  the saved layout; per parameter its name, tensor-parallel
                                  partition (dim, stride), shard shape, tokenizer rows, Adam
                                  step and fragments (tp rank, dp rank, start, stop, file);
                                  the LR schedule's position and the engine's step counters
optim/tpNN-dpMM.safetensors       1-D float32 "<param>/fp32", "<param>/exp_avg",
                                  "<param>/exp_avg_sq": elements [start, stop) of the
                                  flattened shard of tensor-parallel rank NN that
                                  data-parallel rank MM holds; its buffers (dp rank 0)
optim/tpNN-ppKK-dpMM.safetensors  the same at pipeline parallel > 1: stage KK's parameters
```

Parameters are named as the whole model (one stage) names them (models/sharding.global_name:
decoder layers by their global number), so a stage's fragments are found at any split.

The vocabulary's tensors (embedding, output layer, EMO's cost embedding) are padded to a
multiple of make_vocab_size_divisible_by x tensor parallel, a number of rows that differs
between layouts: the state keeps only the tokenizer's rows (the model's vocab_size), so what
is stored is the same whatever the layout, and a load makes the padding rows again, zero.

Loading maps a rank's new range of its new shard to runs of the saved shards (`flat_runs`,
from `slice_plan` / `vocab_plan`) and reads only those byte ranges of the fragments holding
them (memory-mapped, `OpenFiles`). Formats 1 and 2 (one file held each parameter's whole
shard) are still read (`saved_shard`).
"""

from __future__ import annotations

import json
import os
import struct
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..checksums import HashingWriter
from ..errors import UserError, one_line
from ..models.hf_names import padded_names
from ..models.hf_tensors import canonical
from ..models.sharding import merge

OPTIM = "optim"
INDEX = "index.json"
FORMAT = 3
# format 1 (before 2026-12-01) kept the vocabulary's padding rows too: the same rows are read;
# formats 1 and 2 stored each parameter's whole shard in one writer's file (`_load_shards`)
READS = (1, 2, FORMAT)
KEYS = ("fp32", "exp_avg", "exp_avg_sq")  # "fp32": the master weight


class LayoutFreeError(UserError, RuntimeError):
    """A layout-free state that cannot be loaded into this run; the message names it."""


def file_name(tp_rank: int, dp_rank: int, pp_rank: int | None = None) -> str:
    """A rank's file; pp_rank None at one pipeline stage (the name before pipelines)."""
    stage = "" if pp_rank is None else f"-pp{pp_rank:02d}"
    return f"tp{tp_rank:02d}{stage}-dp{dp_rank:02d}.safetensors"


# (partition dim, stride) of our tensor-parallel buffers by name suffix: EMO's cost embedding
# holds this rank's rows of the output layer [V/tp, h]. Other buffers are replicated (a
# sharded one missing here fails the shape check at another tensor-parallel size).
BUFFER_PARTITIONS = {"emo_cost_embedding": (0, 1)}
BUFFER = "buffer"


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


def stored_shape(name: str, shape: tuple[int, ...], vocab: int, tp_rank: int):
    """The shape a rank's shard of `name` is stored in: its tokenizer's rows of a vocabulary
    tensor, the whole shard of any other."""
    if not has_vocab_rows(name):
        return shape
    return (stored_rows(vocab, shape[0], tp_rank), *shape[1:])


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


# One rank's fragments as host tensors: (parameter name, start, stop, {key: [stop - start]})
Pieces = list[tuple[str, int, int, dict[str, torch.Tensor]]]


def stored_numel(name: str, shape: tuple[int, ...], vocab: int, tp_rank: int) -> int:
    """Elements of the flattened shard that are stored: a vocabulary tensor's rows are its
    partition dim 0, so its tokenizer rows are a prefix of the flattened shard."""
    return int(torch.Size(stored_shape(name, shape, vocab, tp_rank)).numel())


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
            shape = stored_shape(entry["name"], tuple(entry["shape"]), entry["vocab_rows"], tp)
            numel = int(torch.Size(shape).numel())
            yield from_fragments(files, entry, key, [(0, tp, 0, numel)], numel).reshape(shape)


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

    path = checkpoint / OPTIM / file_name(owner, entry["writer"], entry.get("pp"))
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


def saved_shard(
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


def vocab_of(checkpoint: Path, entry, name: str, vocab_size: int) -> int | None:
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


def from_fragments(
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


def new_shard(entry, saved_world: int, shape, *, tp_rank: int, tp_size: int, vocab):
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


def layout_free_files(optim_index: dict[str, Any]) -> list[str]:
    """The layout-free state's files a resume at another layout reads: format 3, every file
    a fragment of a parameter is in; formats 1 and 2, the index's writers at every saved
    tensor-parallel rank; the buffers' writers at every saved tensor-parallel rank."""
    tensors = [*optim_index["params"], *optim_index.get("buffers", [])]
    names = {f["file"] for e in tensors for f in e.get("fragments", [])}
    writers = {(e["writer"], e.get("pp")) for e in tensors if "writer" in e}
    tp_size = int(optim_index["tensor_parallel"])
    names |= {file_name(tp, dp, pp) for tp in range(tp_size) for dp, pp in writers}
    return [f"{OPTIM}/{name}" for name in sorted(names)]
