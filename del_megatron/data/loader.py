"""The streaming loader: batches of packed windows for one data-parallel rank, resumable.

Tensor-parallel peers pass the same data-parallel rank and receive identical batches. With
workers, batch i comes from logical worker i % num_workers (torch's in-order round robin);
each batch comes with its worker's state, so `state_dict()` describes exactly what the
training loop has consumed, prefetched batches excluded. The state's format is state.py's,
a change of layout or mix reshard.py's arithmetic; here: iterating, and which of those a
resume takes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from . import reshard
from .config import DataConfig
from .format import DataError, load_manifests
from .state import (
    LOADER_STATE_VERSION,
    RankState,
    SavedState,
    Segment,
    decode_taken,
    mix_of,
    plain,
    read_saved,
    resume_refusal,
    settings_of,
    version_refusal,
)
from .stream import SlotStream, Windows, build_slot_stream
from .trace import traced


class Delivery(NamedTuple):
    """A batch as a worker hands it over: the batch, the logical worker that made it, that
    worker's stream state after it, and the documents whose tokens it trains (the trace's)."""

    batch: dict[str, torch.Tensor]
    worker: int
    state: dict[str, Any]
    documents: list[list[Any]]


def _to_batch(windows: Windows) -> dict[str, torch.Tensor]:
    tokens = torch.from_numpy(windows.tokens.astype(np.int64))
    mask = torch.from_numpy(windows.mask[:, 1:].astype(np.float32))
    return {
        "tokens": tokens[:, :-1],  # [b, s]
        "labels": tokens[:, 1:],  # [b, s], labels[:, t] is the target after tokens[:, t]
        "loss_mask": mask,  # [b, s] float, 0 on padding and prompt targets
    }


class _WorkerStreams(torch.utils.data.IterableDataset):
    """In each DataLoader worker (or the main process): the logical workers it serves."""

    def __init__(self, loader: StreamingLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Delivery]:
        info = torch.utils.data.get_worker_info()
        physical = info.id if info is not None else 0
        loader = self.loader
        workers = loader.workers
        mine = (
            [(physical + loader.offset) % workers]
            if info is not None
            else [(loader.offset + i) % workers for i in range(workers)]
        )
        streams = {w: loader.make_stream(w) for w in mine}
        while True:
            for logical in mine:
                stream = streams[logical]
                if loader.batch_limit is not None and stream.batches >= loader.batch_limit:
                    return
                windows = stream.next_windows()
                if windows is None:  # finite epochs: pad to the common batch count
                    windows = loader.padding_windows()
                    stream.batches += 1
                yield Delivery(_to_batch(windows), logical, stream.state_dict(), windows.documents)


def _worker_errors_as_one_line(batches: Iterator[Delivery]) -> Iterator[Delivery]:
    """A DataError raised in a worker process reaches us wrapped in its traceback text; hand
    it on as the one line it was."""
    try:
        yield from batches
    except DataError as err:
        text = str(err)
        if "Original Traceback" not in text:
            raise
        last = [line for line in text.splitlines() if line.strip()][-1]
        raise DataError(last.split("DataError: ", 1)[-1]) from None


class StreamingLoader:
    """Iterate to get batches {tokens, labels, loss_mask}: LongTensor/float [b, s].

    dp_rank / dp_size: this rank's data-parallel coordinates (not the global rank: tensor-
    parallel peers share them). num_batches: stop after this many batches (every rank alike);
    with cfg.epochs, every rank yields the same number of batches, padded at the end.
    trace: a JSON-lines file this loader appends one line to per batch it hands over
    (segment, batches consumed, the documents trained on); for tests of what was trained.
    """

    def __init__(
        self,
        cfg: DataConfig,
        dp_rank: int = 0,
        dp_size: int = 1,
        *,
        fingerprint: str | None = None,
        num_batches: int | None = None,
        trace: str | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside data-parallel size {dp_size}")
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.num_batches, self.trace = num_batches, trace
        self.manifests = load_manifests(cfg, fingerprint)
        self.workers = max(cfg.num_workers, 1)
        self.slots = dp_size * self.workers
        self.consumed = 0  # batches handed to the caller in this segment
        self.offset = 0  # logical worker of the next batch
        self.worker_states: dict[int, dict[str, Any]] = {}
        sources = len(self.manifests)
        self.segment = Segment(0, [0] * sources, [{} for _ in range(sources)])
        self.segment.batch_limit = self._batches_per_worker(self.segment, [0] * self.slots)

    @property
    def batch_limit(self) -> int | None:
        return self.segment.batch_limit

    # ---- plan -------------------------------------------------------------------------

    def slot(self, logical_worker: int) -> int:
        return self.dp_rank * self.workers + logical_worker

    def make_stream(self, logical_worker: int) -> SlotStream:
        stream = build_slot_stream(
            self.cfg,
            self.manifests,
            self.slot(logical_worker),
            self.slots,
            self.segment.taken,
            self.segment.start,
        )
        if logical_worker in self.worker_states:
            stream.load_state_dict(self.worker_states[logical_worker])
        return stream

    def _batches_per_worker(self, segment: Segment, pending: list[int]) -> int | None:
        """With finite epochs: the most batches any slot of any rank needs from the start of
        `segment` (all pad to it); pending: tokens each slot starts the segment with."""
        if self.cfg.epochs is None:
            return None
        s, b = self.cfg.seq_len, self.cfg.micro_batch_size
        most = 0
        for slot in range(self.slots):
            stream = build_slot_stream(
                self.cfg, self.manifests, slot, self.slots, segment.taken, segment.start
            )
            tokens = pending[slot] + sum(r.planned_tokens(self.cfg.epochs) for r in stream.readers)
            most = max(most, math.ceil(max(tokens - 1, 0) / (b * s)))
        return most

    def padding_windows(self) -> Windows:
        b, s = self.cfg.micro_batch_size, self.cfg.seq_len
        eos = self.manifests[0][1].tokenizer.eos_id
        return Windows(
            tokens=np.full((b, s + 1), eos, np.uint32), mask=np.zeros((b, s + 1), np.uint8)
        )

    # ---- iteration --------------------------------------------------------------------

    def _deliveries(self) -> Iterator[Delivery]:
        dataset = _WorkerStreams(self)
        if not self.cfg.num_workers:
            return iter(dataset)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.cfg.num_workers,
            persistent_workers=False,
            multiprocessing_context="fork",
        )
        return _worker_errors_as_one_line(iter(loader))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        deliveries = self._deliveries()
        if self.num_batches is not None:
            deliveries = itertools.islice(deliveries, max(self.num_batches - self.consumed, 0))
        if self.trace:  # each line before the caller trains on its batch: a kill loses nothing
            segment = self.segment
            deliveries = traced(
                deliveries, self.trace, segment.id, self.dp_rank, self.consumed, segment.follows
            )
        for delivery in deliveries:
            self.worker_states[delivery.worker] = delivery.state
            self.consumed += 1
            self.offset = self.consumed % self.workers
            yield delivery.batch

    # ---- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What has been consumed: enough to continue with the next unseen window, at this
        layout (load_state_dict) or any other (resume). The segment's taken sets are written
        by data-parallel rank 0 only (they are the same on every rank)."""
        return {
            "version": LOADER_STATE_VERSION,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "num_workers": self.workers,
            "consumed": self.consumed,
            "workers": {str(k): plain(v) for k, v in self.worker_states.items()},
            "mix": mix_of(self.cfg, self.manifests),
            "settings": settings_of(self.cfg),
            "segment": self.segment.saved(with_taken=self.dp_rank == 0),
        }

    def load_state_dict(self, state: dict[str, Any], taken: list[dict[str, str]] | None = None):
        """Continue exactly from this rank's own state at the layout it was saved with.
        taken: the segment's taken sets when `state` is not data-parallel rank 0's."""
        refusal = version_refusal(state.get("version"))
        if refusal:
            raise DataError(refusal)
        self._load(RankState.parse(state, "the state"), taken)

    def _load(self, state: RankState, taken: list[dict[str, str]] | None) -> None:
        for field, mine in (
            ("dp_size", self.dp_size),
            ("num_workers", self.workers),
            ("dp_rank", self.dp_rank),
        ):
            if getattr(state, field) != mine:
                raise DataError(
                    f"data-loader state was saved with {field}={getattr(state, field)}, "
                    f"this loader has {field}={mine}"
                )
        self.consumed = state.consumed
        self.offset = self.consumed % self.workers
        self.worker_states = dict(state.workers)
        if state.segment is None:  # version 1
            return
        taken = state.segment.taken if state.segment.taken is not None else taken
        if taken is None:
            raise DataError(
                "this data-loader state keeps its taken documents with data-parallel rank 0's: "
                "resume from the checkpoint's whole data state (StreamingLoader.resume)"
            )
        self.segment = Segment.from_saved(state.segment, decode_taken(taken, self.manifests))

    # ---- resume -----------------------------------------------------------------------

    def resume(self, states: Any) -> str:
        """Continue from a checkpoint's data state (data_state.json as state.read_saved reads
        it: the one record, or the list of per-rank states written before it; or its
        SavedState) whatever layout and data mix it was saved with. Returns one line saying
        what changed ('' when nothing did)."""
        saved = read_saved(states)
        if saved is None:
            return ""
        refusal = resume_refusal(saved.first, self.dp_size, self.workers, len(self.manifests))
        if refusal:
            raise DataError(refusal)
        if saved.first.version == 1:
            self._load(saved.ranks[self.dp_rank], None)
            return ""
        mix = mix_of(self.cfg, self.manifests)
        first = saved.first
        changes = reshard.changes(first, self.dp_size, self.workers, mix, settings_of(self.cfg))
        if not changes:
            self._load(saved.ranks[self.dp_rank], saved.segment.taken)
            return ""
        # as many slots, the same mix and settings: each slot keeps its stream. Not with finite
        # epochs: slots have made unequal batch counts, so ranks would be left with different
        # counts to the end (one would stop while the others wait in a collective)
        if changes.same_slots and changes.same_plan and self.cfg.epochs is None:
            self._continue_slots(saved)
            left = "every loader slot continues its own stream (data parallel x workers unchanged)"
        else:
            left = self._reshard(saved, changes.same_mix)
        lines = changes.lines()
        return "data: " + "; ".join([*lines, left] if left else lines)

    def _next_segment(
        self, saved: SavedState, start: list[int], taken: list[dict[int, Any]]
    ) -> Segment:
        """The segment after the saved one: it follows it from the batches each of its ranks
        had consumed (the trace cuts what a kill lost there), named by what it continues and
        how it reads."""
        follows = {"segment": saved.segment.id, "consumed": saved.consumed()}
        mix, settings = mix_of(self.cfg, self.manifests), settings_of(self.cfg)
        name = json.dumps([follows, self.dp_size, self.workers, mix, settings])
        return Segment(
            saved.segment.number + 1,
            start,
            taken,
            id=hashlib.sha256(name.encode()).hexdigest()[:12],
            follows=follows,
        )

    def _continue_slots(self, saved: SavedState) -> None:
        """Another data-parallel size and worker count with as many slots as before
        (dp x workers), the mix and settings unchanged: slot s keeps its stream, so the run
        reads the documents in the order an unchanged run would. A new segment (for the
        trace) over the same plan: the old segment's start and taken sets."""
        segment = saved.segment
        assert segment.taken is not None  # rank 0's state keeps them
        self.segment = self._next_segment(
            saved, list(segment.start), decode_taken(segment.taken, self.manifests)
        )
        self.segment.batch_limit = segment.batch_limit
        slot_states = saved.slot_states()
        self.worker_states = {}
        for worker in range(self.workers):
            state = slot_states[self.slot(worker)]
            if state is not None:  # else that slot had not made a batch yet: it starts fresh
                self.worker_states[worker] = state
        self.consumed = self.offset = 0

    def _reshard(self, saved: SavedState, same_mix: bool) -> str:
        """Start a new segment from states saved at another layout or mix (reshard.py).
        Returns what is left, in words."""
        new = reshard.reshard(saved, self.manifests, self.slots, same_mix)
        self.segment = self._next_segment(saved, new.start, new.taken)
        self.segment.batch_limit = self._batches_per_worker(
            self.segment, [len(state["pending_tokens"]) for state in new.slot_states]
        )
        self.worker_states = {w: new.slot_states[self.slot(w)] for w in range(self.workers)}
        self.consumed = self.offset = 0
        return "; ".join(new.left)

    @property
    def skipped_shards(self) -> list[str]:
        names: list[str] = []
        for state in self.worker_states.values():
            names += [n for n in state["skipped"] if n not in names]
        return names
