"""What is left of an epoch: the documents already taken, and each slot's part of the rest.

Documents are numbered per source in manifest order (shard i, sample j -> offsets[i] + j), so
a *taken set* (a bool per document of one source and one epoch) says what was read whoever
read it. An epoch's order is fixed by (seed, source, epoch[, shard]); a slot's plan is that
order minus the taken set, split among the slots: whole shards while at least as many shards
have documents left as there are slots, else every slots-th document. With nothing taken this
is exactly the plan of a run that never changed layout.

At a layout change the taken set of every epoch some slot had reached becomes the set taken
at the segment's start plus every old slot's prefix of its plan (a pure function of its saved
position), and the new slots split what is left. All functions here are pure.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import one_line
from .format import DataError, Manifest


def rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))


@dataclass(frozen=True)
class Order:
    """How a source's epoch is ordered: the run's seed and shuffle flag and the source's index
    in data.sources (part of the random key)."""

    seed: int
    shuffle: bool
    index: int


@dataclass(frozen=True)
class SlotPlan:
    shards: list[int]  # shard indices this slot reads in the epoch, in order
    striding: bool  # every slot reads every shard, keeping every slots-th document


def offsets(manifest: Manifest) -> np.ndarray:
    """[shards + 1] first document number of each shard (the last: the document count)."""
    return np.concatenate([[0], np.cumsum([e.samples for e in manifest.shards])]).astype(np.int64)


def shard_order(manifest: Manifest, order: Order, epoch: int) -> np.ndarray:
    n = len(manifest.shards)
    if not order.shuffle:
        return np.arange(n)
    return rng(order.seed, order.index, epoch).permutation(n)


def sample_order(order: Order, epoch: int, shard: int, count: int) -> np.ndarray:
    """The reading order of a shard's `count` samples."""
    if not order.shuffle or not count:
        return np.arange(count)
    return rng(order.seed, order.index, epoch, shard).permutation(count)


def slot_plan(
    manifest: Manifest,
    order: Order,
    epoch: int,
    taken: np.ndarray | None,
    slot: int,
    slots: int,
    shards: list[int] | None = None,
) -> SlotPlan:
    """The shards `slot` of `slots` reads in `epoch` when `taken` [documents] (None: nothing)
    were read before: fully taken shards leave the plan. shards: remaining_shards(...) if
    the caller has it."""
    if shards is None:
        shards = remaining_shards(manifest, order, epoch, taken)
    striding = len(shards) < slots
    mine = shards if striding else shards[slot::slots]
    return SlotPlan([int(s) for s in mine], striding)


def remaining_shards(
    manifest: Manifest, order: Order, epoch: int, taken: np.ndarray | None
) -> list[int]:
    """The epoch's shard order without the shards whose every document was taken."""
    shards = shard_order(manifest, order, epoch)
    if taken is None:
        return [int(s) for s in shards]
    first = offsets(manifest)
    counts = np.concatenate([[0], np.cumsum(taken)])
    full = counts[first[1:]] - counts[first[:-1]] == first[1:] - first[:-1]
    return [int(s) for s in shards if not full[s]]


def left_in_shard(
    manifest: Manifest, order: Order, epoch: int, shard: int, taken: np.ndarray | None
) -> np.ndarray:
    """Sample indices of `shard` not yet taken, in reading order."""
    samples = sample_order(order, epoch, shard, manifest.shards[shard].samples)
    if taken is None:
        return samples
    first = int(offsets(manifest)[shard])
    return samples[~taken[first + samples]]


@dataclass(frozen=True)
class ShardReads:
    """One shard of a slot's plan for an epoch as the slot reads it: `samples`, the shard's
    samples not yet taken in reading order (none when the slot cannot read the shard), of which
    the slot reads those at `first::step`. seen: documents of the epoch's stream before this
    shard; shard_pos: its index in the plan."""

    shard_pos: int
    shard: int
    samples: np.ndarray
    seen: int
    first: int
    step: int

    def mine(self) -> np.ndarray:
        """Indices into `samples` of the documents this slot reads."""
        return np.arange(self.first, len(self.samples), self.step)

    def next_from(self, index: int) -> int | None:
        """The first index >= `index` into `samples` this slot reads (None: none left)."""
        found = index + (self.first - index) % self.step
        return found if found < len(self.samples) else None


def slot_reads(
    plan: SlotPlan,
    left: Callable[[int], np.ndarray],
    slot: int,
    slots: int,
    shard_pos: int = 0,
    seen: int = 0,
) -> Iterator[ShardReads]:
    """The rule of which documents a slot reads in an epoch, the one place it is written:
    the plan's shards in order; in each, the samples not yet taken in reading order
    (`left(shard)`: empty for a shard the slot cannot read); all of them in a whole-shard plan,
    in a striding plan every slots-th of the epoch's stream (the documents of the plan's
    readable shards in order), from the slot's own index. From the plan's shard `shard_pos`
    on, `seen` documents of the stream before it."""
    for pos in range(shard_pos, len(plan.shards)):
        shard = plan.shards[pos]
        samples = left(shard)
        first, step = ((slot - seen) % slots, slots) if plan.striding else (0, 1)
        yield ShardReads(pos, shard, samples, seen, first, step)
        seen += len(samples)


def read_prefix(
    manifest: Manifest,
    order: Order,
    epoch: int,
    taken: np.ndarray | None,
    slot: int,
    slots: int,
    position: dict[str, int] | None,
    skipped: set[int],
    cache: dict[Any, Any] | None = None,
) -> np.ndarray:
    """Document numbers one slot took in `epoch` up to `position` (a SourceReader position in
    that epoch; None: its whole plan). Shards in `skipped` (unreadable to it) that it passed
    count as taken: they stay skipped. cache: the caller's, of what is the same for every slot
    (remaining shards, each shard's samples left), for calls of one `taken`."""
    cache = {} if cache is None else cache
    if ("shards", epoch) not in cache:
        cache[("shards", epoch)] = remaining_shards(manifest, order, epoch, taken)
    plan = slot_plan(manifest, order, epoch, taken, slot, slots, cache[("shards", epoch)])
    first = offsets(manifest)
    shard_pos = len(plan.shards) if position is None else position["shard_pos"]
    unread = set(plan.shards[:shard_pos]) & skipped
    out = [np.arange(first[s], first[s + 1]) for s in unread]

    def left(shard: int) -> np.ndarray:
        if shard in unread:
            return np.zeros(0, np.int64)
        if (epoch, shard) not in cache:
            cache[(epoch, shard)] = left_in_shard(manifest, order, epoch, shard, taken)
        return cache[(epoch, shard)]

    for reads in slot_reads(plan, left, slot, slots):
        if reads.shard_pos > shard_pos:
            break
        mine = reads.mine()
        if reads.shard_pos == shard_pos and position is not None:
            mine = mine[mine < position["sample_pos"]]
        out.append(first[reads.shard] + reads.samples[mine])
    return np.concatenate([np.zeros(0, np.int64), *out]).astype(np.int64)


def encode(taken: np.ndarray) -> str:
    """A taken set as text: zlib of the packed bits, base64 (whole shards taken are runs and
    compress well; 10M documents are at most 1.25 MB before compression)."""
    return base64.b64encode(zlib.compress(np.packbits(taken).tobytes(), 6)).decode("ascii")


def decode(text: str, documents: int) -> np.ndarray:
    try:
        bits = np.frombuffer(zlib.decompress(base64.b64decode(text, validate=True)), np.uint8)
        if len(bits) * 8 < documents:
            raise ValueError(f"{len(bits) * 8} bits for {documents} documents")
    except (TypeError, ValueError, zlib.error) as err:  # binascii.Error is a ValueError
        raise DataError(
            f"data_state.json: a taken-document set is corrupt ({one_line(err)[:120]}): "
            "resume from another checkpoint"
        ) from None
    return np.unpackbits(bits, count=documents).astype(bool)


def fingerprint(manifest: Manifest) -> str:
    """Identifies a manifest's content (its shards and their checksums)."""
    return hashlib.sha256(manifest.to_json().encode()).hexdigest()[:16]
