"""A rank's part of the layout-free optimizer state (format: optim_format.py), saved from and
loaded into its engine's optimizer through the engine's adapter (checkpoint/adapter.py).

Saving copies each rank's own ranges to the host (`snapshot`: no collective; one gather of
the fragment table for the index), then streams them into its file behind training
(`save_job`'s job: `optim_format.write_pieces`, host tensors only). Loading maps this rank's
new range of its new shard to runs of the saved shards and sets them into the optimizer's
own range with no collective (`load`), then the weights from the masters.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..models.hf_tensors import canonical
from ..models.sharding import partition_of_param
from .adapter import Adapter
from .host import host_copies
from .optim_format import (
    BUFFER,
    FORMAT,
    INDEX,
    KEYS,
    OPTIM,
    LayoutFreeError,
    OpenFiles,
    Pieces,
    buffer_partition,
    file_name,
    flat_runs,
    from_fragments,
    has_vocab_rows,
    new_shard,
    read_index,
    saved_shard,
    stored_numel,
    stored_shape,
    vocab_of,
    write_pieces,
)

# ---- save -------------------------------------------------------------------------------


def snapshot(adapter: Adapter, *, tp_rank: int, vocab_size: int) -> Pieces:
    """This rank's ranges of every trained parameter that it writes (`adapter.owned`,
    `adapter.writes`, cut to the stored elements), master and both moments, copied to the
    host in float32: no collective, and nothing the next optimizer step changes (on CPU too,
    where the optimizer's tensors are host tensors already). The copies are queued
    (`host.host_copies`): read them after the device is waited for (`save.save`, once a
    save). A replicated parameter is kept by tensor-parallel rank 0's ranks only (every
    tensor-parallel rank holds the same)."""
    ranges: list[tuple[str, int, int, list[torch.Tensor]]] = []  # on the device
    for name, param in adapter.parameters():
        span = adapter.owned(param)
        if span is None or not adapter.writes(param):
            continue
        if partition_of_param(param) is None and tp_rank > 0:
            continue
        start = span[0]
        stop = min(span[1], stored_numel(name, adapter.shard_shape(param), vocab_size, tp_rank))
        if stop <= start:  # a range of padding rows only
            continue
        views = [adapter.get(param, key).narrow(0, 0, stop - start).detach() for key in KEYS]
        ranges.append((name, start, stop, views))
    copies = iter(host_copies((v for *_, views in ranges for v in views), torch.float32))
    return [(n, start, stop, {key: next(copies) for key in KEYS}) for n, start, stop, _ in ranges]


def _described(adapter: Adapter, vocab_size: int, pp_rank: int | None) -> dict[str, list]:
    """The index's entries of this stage's parameters and buffers, without fragments (every
    tensor-parallel rank's shard has the same shape)."""
    params = [
        {
            "name": n,
            "canonical": canonical(n),
            "partition": partition_of_param(param),
            "shape": list(adapter.shard_shape(param)),  # in the model; stored: `vocab_rows`
            "vocab_rows": vocab_size if has_vocab_rows(n) else None,
        }
        for n, param in adapter.parameters()
    ]
    stage = {} if pp_rank is None else {"pp": pp_rank}
    buffers = [
        {
            "name": n,
            "canonical": canonical(n),
            "partition": buffer_partition(n),
            "shape": list(buffer.shape),
            "vocab_rows": vocab_size if has_vocab_rows(n) else None,
            "writer": 0,
            **stage,
        }
        for n, buffer in adapter.buffers()
    ]
    return {"params": params, "buffers": buffers}


def save_job(
    adapter: Adapter,
    directory: Path,
    *,
    tp_rank: int,
    tp_size: int,
    dp_rank: int,
    dp_size: int,
    pp_size: int,
    vocab_size: int,
    extra: dict[str, Any],
) -> Callable[[], dict[str, dict[str, Any]]]:
    """This rank's part of `directory/optim/`, in two halves. Now (every rank must call it):
    a host copy of its own ranges and buffers (`snapshot`; queued: the job may run only after
    the device is waited for, as `save.save` does) and one gather of the fragment table, a few
    bytes a parameter (no full-tensor collective). Returned: the job that writes them, and on
    global rank 0 the index, with `extra` (schedule, counters) in it — host data only, no
    collective, so it can run behind training (checkpoint/writer.py). `vocab_size`: the
    model's (unpadded) vocabulary rows, the ones kept of its vocabulary tensors. The job
    returns {each file's path under `directory`: its size and SHA-256}, the files flushed to
    the disk."""
    from .. import collectives
    from .writer import flushed

    out = directory / OPTIM
    out.mkdir(exist_ok=True)
    adapter.prepare()
    pp_rank = adapter.pp_rank
    step = max(adapter.adam_steps().values(), default=0)  # every group steps together
    pieces = snapshot(adapter, tp_rank=tp_rank, vocab_size=vocab_size)
    # buffers are the same on every data-parallel rank: data-parallel rank 0 writes them
    buffers = [
        (name, b.narrow(0, 0, stored_shape(name, tuple(b.shape), vocab_size, tp_rank)[0]))
        for name, b in (adapter.buffers() if dp_rank == 0 else [])
    ]
    buffers = list(zip([n for n, _ in buffers], host_copies(b for _, b in buffers), strict=True))
    name = file_name(tp_rank, dp_rank, pp_rank)
    metadata = {"format": str(FORMAT), "tensor_parallel_rank": str(tp_rank)}
    table = [(n, start, stop) for n, start, stop, _ in pieces]
    # one rank of each stage describes its tensors (tensor- and data-parallel rank 0)
    described = _described(adapter, vocab_size, pp_rank) if tp_rank == dp_rank == 0 else None
    # to global rank 0 alone, the index's writer: no rank but it receives the world's tables
    tables = collectives.gather_object((tp_rank, dp_rank, pp_rank, step, table, described))
    index = None
    if tables is not None:
        stages = sorted((t for t in tables if t[5] is not None), key=lambda t: t[2] or 0)
        params = [entry for t in stages for entry in t[5]["params"]]
        where: dict[str, list[dict[str, Any]]] = {entry["name"]: [] for entry in params}
        for tp, dp, pp, _, held, _ in tables:
            for n, start, stop in held:
                where[n].append(
                    {
                        "tp": tp,
                        "dp": dp,
                        "start": start,
                        "stop": stop,
                        "file": file_name(tp, dp, pp),
                    }
                )
        steps = max(t[3] for t in tables)
        index = {
            "format": FORMAT,
            "tensor_parallel": tp_size,
            "data_parallel": dp_size,
            "pipeline_parallel": pp_size,
            "params": [
                {
                    **entry,
                    "step": steps,
                    "fragments": sorted(where[entry["name"]], key=lambda f: (f["tp"], f["start"])),
                }
                for entry in params
            ],
            "buffers": [entry for t in stages for entry in t[5]["buffers"]],
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


def _load_fragments(
    adapter: Adapter,
    params,
    saved,
    checkpoint: Path,
    index,
    *,
    tp_rank: int,
    tp_size: int,
    vocab_size: int,
) -> None:
    """Format 3: per parameter, this rank's own range (`adapter.owned`) of its new shard,
    mapped to runs of the saved shards (`flat_runs`), read by byte range from the fragments
    holding them and set with no collective (`adapter.put`)."""
    with OpenFiles(checkpoint) as files:
        for name, param in params:
            entry = saved[canonical(name)]
            shape = adapter.shard_shape(param)
            vocab = vocab_of(checkpoint, entry, name, vocab_size)
            try:
                dim, pieces = new_shard(
                    entry,
                    index["tensor_parallel"],
                    shape,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    vocab=vocab,
                )
            except LayoutFreeError as err:
                raise LayoutFreeError(f"{checkpoint / OPTIM}: {err}") from None
            span = adapter.owned(param)
            if span is None:
                continue
            runs = flat_runs(pieces, shape, dim, entry["shape"][dim], *span)
            for key in KEYS:
                value = from_fragments(files, entry, key, runs, span[1] - span[0])
                adapter.put(param, key, value)


def _load_shards(
    adapter: Adapter,
    params,
    saved,
    checkpoint: Path,
    index,
    *,
    tp_rank: int,
    tp_size: int,
    vocab_size: int,
) -> None:
    """Formats 1 and 2: each parameter's saved shards whole, this rank's range of its shard
    of them set through the adapter."""
    for name, param in params:
        entry = saved[canonical(name)]
        shape = adapter.shard_shape(param)
        vocab = vocab_of(checkpoint, entry, name, vocab_size)
        span = adapter.owned(param)
        for key in KEYS:
            value = saved_shard(
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
            if span is not None:
                adapter.put(param, key, value.reshape(-1)[span[0] : span[1]])


def load(
    adapter: Adapter,
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
    params = [*adapter.parameters(), *adapter.copies()]
    names = {canonical(name) for name, _ in params}
    # a pipeline stage holds some of the saved parameters, the whole model all of them
    extra = set(saved) - names if adapter.pp_rank is None else set()
    if not names <= set(saved) or extra:
        missing, extra = sorted(names - set(saved)), sorted(extra)
        raise LayoutFreeError(
            f"{checkpoint / OPTIM}: parameters differ from this model's "
            f"(missing {missing[:3]}, not in the model {extra[:3]})"
        )
    for name, param in params:
        partition = saved[canonical(name)]["partition"]
        if (partition and tuple(partition)) != partition_of_param(param):
            raise LayoutFreeError(f"{checkpoint / OPTIM}: {name} is partitioned differently")
    steps = {int(entry["step"]) for entry in index["params"]}
    if len(steps) != 1:
        # the engine steps every group together; different counts are not ours to merge
        raise LayoutFreeError(f"{checkpoint / OPTIM}: Adam step counts differ: {sorted(steps)}")
    adapter.prepare()
    layout = {"tp_rank": tp_rank, "tp_size": tp_size, "vocab_size": vocab_size}
    if index["format"] >= 3:
        _load_fragments(adapter, params, saved, checkpoint, index, **layout)
    else:
        _load_shards(adapter, params, saved, checkpoint, index, **layout)
    adapter.set_adam_step(steps.pop())
    adapter.masters_to_weights()
    _load_buffers(adapter, checkpoint, index, **layout)
    return index


def _load_buffers(
    adapter: Adapter, checkpoint: Path, index, *, tp_rank: int, tp_size: int, vocab_size: int
) -> None:
    """The saved buffers into this rank's modules: EMO's cost embedding is made from the
    weights the run started from, which a run at another layout need not make again alike
    (GPU initialization draws each tensor-parallel shard from its own generator)."""
    saved = {entry["canonical"]: entry for entry in index.get("buffers", [])}
    for name, buffer in adapter.buffers():
        entry = saved.get(canonical(name))
        if entry is None:
            raise LayoutFreeError(f"{checkpoint / OPTIM}: no buffer {name}")
        vocab = vocab_of(checkpoint, entry, name, vocab_size)
        value = saved_shard(
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
