"""Deterministic, resumable document streams and the packing of documents into windows.

A *slot* is one (data-parallel rank, loader worker) pair; slots = dp_size * num_workers.
Each slot reads its own part of every source: whole shards when a source has at least as
many shards as there are slots, else every shard with every slots-th sample. The order
depends only on (seed, source, epoch[, shard]), so every position is a handful of integers
and a resumed stream continues with the next unseen token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .config import DataConfig
from .cursor import Order, ShardReads, SlotPlan, left_in_shard, offsets, slot_plan, slot_reads
from .format import DataError, Document, Manifest, read_shard, resolve

log = logging.getLogger(__name__)
STATE_VERSION = 2  # 2: pending_docs (which documents the pending tokens are)


@dataclass
class ReaderPosition:
    epoch: int = 0
    shard_pos: int = 0  # index into this slot's shard plan for the epoch
    sample_pos: int = 0  # index into the (permuted, not yet taken) samples of that shard
    seen: int = 0  # samples passed in the epoch so far (for per-sample striding)
    taken: int = 0  # documents this slot took in the epoch so far


class DocumentAt(NamedTuple):
    """A document and where it is: the epoch, the shard's index in the manifest, the sample's
    index in the shard."""

    epoch: int
    shard: int
    sample: int
    document: Document


class SourceReader:
    """The documents of one source that belong to one slot, in order.

    taken: per epoch, the documents [manifest order] read before this segment of the run
    (cursor.py); start_epoch: the epoch the segment starts in for this source.
    """

    def __init__(
        self,
        url: str,
        manifest: Manifest,
        index: int,
        slot: int,
        slots: int,
        cfg: DataConfig,
        skipped: list[str],
        taken: dict[int, np.ndarray] | None = None,
        start_epoch: int = 0,
    ) -> None:
        self.url, self.manifest, self.index = url, manifest, index
        self.slot, self.slots, self.cfg = slot, slots, cfg
        self.order = Order(cfg.seed, cfg.shuffle, index)
        self.taken = taken or {}
        self.position = ReaderPosition(epoch=start_epoch)
        self.skipped = skipped  # shared per slot: names of skipped shards
        self._loaded: tuple[tuple[int, int], tuple[np.ndarray, list[Document]]] | None = None
        self._plan: tuple[int, SlotPlan] | None = None

    def plan(self, epoch: int) -> SlotPlan:
        """The shards this slot reads in `epoch`."""
        if self._plan is None or self._plan[0] != epoch:
            plan = slot_plan(
                self.manifest, self.order, epoch, self.taken.get(epoch), self.slot, self.slots
            )
            self._plan = (epoch, plan)
        return self._plan[1]

    def _shard(self, epoch: int, shard: int) -> tuple[np.ndarray, list[Document]]:
        """A shard's samples not yet taken, in reading order (none when it cannot be read and
        on_error is skip), and its documents by sample index."""
        if self._loaded is not None and self._loaded[0] == (epoch, shard):
            return self._loaded[1]
        entry = self.manifest.shards[shard]
        location = resolve(self.url, entry.name)
        try:
            docs = read_shard(location, entry, allow_pipe=self.cfg.allow_pipe)
        except DataError as err:
            if self.cfg.on_error == "fail":
                raise
            log.warning("skipping shard: %s", err)
            if location not in self.skipped:
                self.skipped.append(location)
            docs = []
        samples = (
            left_in_shard(self.manifest, self.order, epoch, shard, self.taken.get(epoch))
            if docs
            else np.zeros(0, np.int64)
        )
        self._loaded = ((epoch, shard), (samples, docs))
        return samples, docs

    def _reads(self, epoch: int, shard_pos: int = 0, seen: int = 0) -> Iterator[ShardReads]:
        """This slot's reads of `epoch` from the plan's shard `shard_pos` on (cursor.slot_reads),
        the shards read as they are reached."""
        return slot_reads(
            self.plan(epoch),
            lambda shard: self._shard(epoch, shard)[0],
            self.slot,
            self.slots,
            shard_pos,
            seen,
        )

    def next_document(self) -> DocumentAt | None:
        """The next document, or None once cfg.epochs epochs are done."""
        pos = self.position
        while True:
            if self.cfg.epochs is not None and pos.epoch >= self.cfg.epochs:
                return None
            for reads in self._reads(pos.epoch, pos.shard_pos, pos.seen - pos.sample_pos):
                index = reads.next_from(pos.sample_pos)
                if index is None:  # on to the next shard
                    pos.shard_pos, pos.sample_pos = reads.shard_pos + 1, 0
                    pos.seen = reads.seen + len(reads.samples)
                    continue
                pos.shard_pos, pos.sample_pos = reads.shard_pos, index + 1
                pos.seen = reads.seen + index + 1
                pos.taken += 1
                sample = int(reads.samples[index])
                document = self._shard(pos.epoch, reads.shard)[1][sample]
                return DocumentAt(pos.epoch, reads.shard, sample, document)
            # a whole epoch without a document would stream on forever; the rest of an
            # epoch (after a layout change) may leave this slot nothing
            if pos.taken == 0 and self.taken.get(pos.epoch) is None:
                raise DataError(
                    f"{self.url}: no readable document for data-parallel slot {self.slot} "
                    f"of {self.slots} (fewer documents than ranks x workers, or every "
                    "shard skipped)"
                )
            self.position = pos = ReaderPosition(epoch=pos.epoch + 1)

    def planned_tokens(self, epochs: int) -> int:
        """Tokens plus one EOS per document this slot reads from its position (the start of a
        segment) to the end of epoch `epochs` - 1."""
        return sum(self._planned_tokens_of(epoch) for epoch in range(self.position.epoch, epochs))

    def _planned_tokens_of(self, epoch: int) -> int:
        """A whole epoch's: manifest counts for a shard this slot reads entire (a whole-shard
        plan's shard none of which was taken before); the rest are read to count."""
        plan, taken, first = self.plan(epoch), self.taken.get(epoch), offsets(self.manifest)

        def entire(shard: int) -> bool:
            return not plan.striding and (
                taken is None or not taken[first[shard] : first[shard + 1]].any()
            )

        def left(shard: int) -> np.ndarray:  # an entire shard's samples are not needed
            return np.zeros(0, np.int64) if entire(shard) else self._shard(epoch, shard)[0]

        total = 0
        for reads in slot_reads(plan, left, self.slot, self.slots):
            if entire(reads.shard):
                entry = self.manifest.shards[reads.shard]
                total += entry.tokens + entry.samples
            else:
                docs = self._shard(epoch, reads.shard)[1]
                total += sum(len(docs[s].tokens) + 1 for s in reads.samples[reads.mine()])
        return total

    def state_dict(self) -> dict[str, int]:
        return dict(vars(self.position))

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = ReaderPosition(**state)


@dataclass
class Windows:
    """micro_batch_size packed windows: tokens [b, s+1] (uint32), target mask [b, s+1];
    documents: [manifest, epoch, shard, sample, tokens] of each document whose tokens entered
    training in these windows (a stream's first token counts: every document's tokens plus
    its EOS add up to len + 1 over the batches it spans)."""

    tokens: np.ndarray
    mask: np.ndarray
    documents: list[list[Any]] = field(default_factory=list)


@dataclass
class SlotStream:
    """Mixes the sources of one slot by tokens and packs documents into windows."""

    cfg: DataConfig
    readers: list[SourceReader]
    eos_id: int
    drawn: list[int] = field(default_factory=list)  # tokens taken from each source
    pending_tokens: list[np.ndarray] = field(default_factory=list)
    pending_mask: list[np.ndarray] = field(default_factory=list)
    # [manifest, epoch, shard, sample, tokens] of the pending tokens not yet trained on, in
    # order: all but the first, which the last window ended with (none before the first window)
    pending_docs: list[list[Any]] = field(default_factory=list)
    batches: int = 0
    exhausted: list[bool] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drawn = self.drawn or [0] * len(self.readers)
        self.exhausted = self.exhausted or [False] * len(self.readers)
        self.weights = [s.weight for s in self.cfg.sources]
        self.pending = sum(len(t) for t in self.pending_tokens)
        self._eos = np.array([self.eos_id], np.uint32)
        self._ones = np.ones(0, np.uint8)  # grown on demand; documents' masks are views of it

    def _ones_view(self, n: int) -> np.ndarray:
        if len(self._ones) < n:
            self._ones = np.ones(max(n, 2 * len(self._ones), 4096), np.uint8)
        return self._ones[:n]

    def _draw(self) -> bool:
        """Append the next document of the source furthest behind its share; False when none."""
        while not all(self.exhausted):
            source = min(
                (i for i in range(len(self.readers)) if not self.exhausted[i]),
                key=lambda i: self.drawn[i] / self.weights[i],
            )
            found = self.readers[source].next_document()
            if found is None:
                self.exhausted[source] = True
                continue
            doc = found.document
            n = len(doc.tokens)
            if doc.mask is None and not self.cfg.mask_after_boundary:
                self.pending_mask += [self._ones_view(n + 1)]
            else:
                mask = np.ones(n + 1, dtype=np.uint8)
                if doc.mask is not None:
                    mask[:n] = doc.mask
                if self.cfg.mask_after_boundary and n:
                    mask[0] = 0
                self.pending_mask.append(mask)
            self.pending_tokens += [doc.tokens, self._eos]
            self.pending_mask.append(self._ones_view(0))  # keeps the two lists in step
            where = [self.readers[source].url, found.epoch, found.shard, found.sample]
            self.pending_docs.append([*where, n + 1])
            self.drawn[source] += n + 1
            self.pending += n + 1
            return True
        return False

    def _trained(self, count: int) -> list[list[Any]]:
        """The first `count` untrained pending tokens, as pieces of documents."""
        pieces = []
        while count > 0 and self.pending_docs:
            head = self.pending_docs[0]
            take = min(count, head[-1])
            pieces.append([*head[:-1], take])
            count -= take
            if take == head[-1]:
                self.pending_docs.pop(0)
            else:
                self.pending_docs[0] = [*head[:-1], head[-1] - take]
        return pieces

    def next_windows(self) -> Windows | None:
        """The next micro-batch of windows, None when every source is exhausted (finite
        epochs) and nothing is pending. Consecutive windows share one token (as Megatron's)."""
        s, b = self.cfg.seq_len, self.cfg.micro_batch_size
        need = b * s + 1
        while self.pending < need and self._draw():
            pass
        length = self.pending
        if length <= 1 and all(self.exhausted):
            return None
        overlap = length - sum(d[-1] for d in self.pending_docs)  # 1 after a window, else 0
        tokens = np.concatenate([*self.pending_tokens, np.zeros(0, np.uint32)])
        mask = np.concatenate([*self.pending_mask, np.zeros(0, np.uint8)])
        if length < need:  # the end of a finite stream: pad with masked EOS
            tokens = np.concatenate([tokens, np.full(need - length, self.eos_id, np.uint32)])
            mask = np.concatenate([mask, np.zeros(need - length, np.uint8)])
        starts = np.arange(b) * s
        index = starts[:, None] + np.arange(s + 1)[None, :]
        out = Windows(tokens=tokens[index], mask=mask[index])
        out.documents = self._trained(min(length, need) - overlap)
        if length >= need:  # keep the last token: the next window starts with it
            self.pending_tokens, self.pending_mask = [tokens[b * s :]], [mask[b * s :]]
            self.pending = length - b * s
        else:
            self.pending_tokens, self.pending_mask, self.pending = [], [], 0
            self.pending_docs = []
            self.exhausted = [True] * len(self.readers)
        self.batches += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "readers": [r.state_dict() for r in self.readers],
            "drawn": list(self.drawn),
            "exhausted": list(self.exhausted),
            # the partly packed window (numpy here; lists once the loader saves its state)
            "pending_tokens": (
                np.concatenate(self.pending_tokens)
                if self.pending_tokens
                else np.zeros(0, np.uint32)
            ),
            "pending_mask": (
                np.concatenate(self.pending_mask) if self.pending_mask else np.zeros(0, np.uint8)
            ),
            "pending_docs": [list(d) for d in self.pending_docs],
            "batches": self.batches,
            "skipped": list(self.skipped),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") not in (1, STATE_VERSION):
            raise DataError(
                f"data-loader state version {state.get('version')} is not {STATE_VERSION}"
            )
        if len(state["readers"]) != len(self.readers):
            raise DataError(
                f"data-loader state has {len(state['readers'])} sources, data.sources "
                f"{len(self.readers)}: resume with the data.sources it was saved with"
            )
        for reader, reader_state in zip(self.readers, state["readers"], strict=True):
            reader.load_state_dict(reader_state)
        self.drawn = list(state["drawn"])
        self.exhausted = list(state["exhausted"])
        tokens = np.array(state["pending_tokens"], dtype=np.uint32)
        mask = np.array(state["pending_mask"], dtype=np.uint8)
        self.pending_tokens, self.pending_mask = ([tokens], [mask]) if len(tokens) else ([], [])
        self.pending = len(tokens)
        # version 1 did not say which documents were pending
        unknown = [[None, -1, -1, -1, len(tokens) - 1]] if len(tokens) > 1 else []
        self.pending_docs = [list(d) for d in state.get("pending_docs", unknown)]
        self.batches = state["batches"]
        self.skipped[:] = state["skipped"]


def build_slot_stream(
    cfg: DataConfig,
    manifests: list[tuple[str, Manifest]],
    slot: int,
    slots: int,
    taken: list[dict[int, np.ndarray]] | None = None,
    start: list[int] | None = None,
) -> SlotStream:
    """taken / start: per source, what the run's segment began with (cursor.py)."""
    skipped: list[str] = []
    readers = [
        SourceReader(
            url,
            manifest,
            i,
            slot,
            slots,
            cfg,
            skipped,
            taken[i] if taken else None,
            start[i] if start else 0,
        )
        for i, (url, manifest) in enumerate(manifests)
    ]
    return SlotStream(
        cfg=cfg, readers=readers, eos_id=manifests[0][1].tokenizer.eos_id, skipped=skipped
    )
