"""The streaming loader: batches of packed windows for one data-parallel rank, resumable.

Tensor-parallel peers pass the same data-parallel rank and receive identical batches. With
workers, batch i comes from logical worker i % num_workers (torch's in-order round robin);
each batch carries its worker's state, so `state_dict()` describes exactly what the training
loop has consumed, prefetched batches excluded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import cursor
from .config import DataConfig
from .cursor import encode
from .format import DataError, Manifest, check_listed_shards, read_manifest, resolve
from .stream import STATE_VERSION, SlotStream, Windows, build_slot_stream
from .trace import batch_line, start_line

LOADER_STATE_VERSION = 2  # 2: the segment's taken sets, the mix and order; any layout
READABLE_VERSIONS = (1, 2)


def resume_refusal(state: dict[str, Any], dp_size: int, num_workers: int, sources: int) -> str:
    """Why a saved per-rank state cannot be resumed by a loader of this layout ('' if it can):
    one sentence naming the fix. A version 2 state continues at any layout and data mix; a
    version 1 state (saved before the cursor resharded) only at its own."""
    version = state.get("version")
    if version not in READABLE_VERSIONS:
        return (
            f"its data-loader state has version {version}, this del-megatron reads "
            f"{' and '.join(map(str, READABLE_VERSIONS))}: resume with the del-megatron that "
            "wrote it"
        )
    if version != 1:
        return ""
    workers = max(num_workers, 1)
    if state.get("dp_size") != dp_size:
        return (
            f"its data-loader state (version 1, written before the data cursor could change "
            f"layout) was saved at data-parallel size {state.get('dp_size')}, this run has "
            f"{dp_size}: resume at data-parallel size {state.get('dp_size')} (world size / "
            "parallel.tensor_parallel), then any later checkpoint resumes at any layout"
        )
    if state.get("num_workers") != workers:
        return (
            f"its data-loader state was saved with data.num_workers={state.get('num_workers')}"
            f", this run has {workers}: resume with data.num_workers={state.get('num_workers')}"
        )
    for worker in state.get("workers", {}).values():
        saved = len(worker.get("readers", []))
        if saved != sources:
            return (
                f"its data-loader state has {saved} sources and data.sources has {sources}: "
                "resume with the data.sources it was saved with (its run_config.yaml), or start "
                "a new run in another output_dir"
            )
    return ""


STATE_FIELDS = {  # what a per-rank state of each version holds at its top level
    1: ("dp_rank", "dp_size", "num_workers", "consumed", "workers"),
    2: ("dp_rank", "dp_size", "num_workers", "consumed", "workers", "segment", "mix", "settings"),
}


def states_by_rank(states: Any) -> dict[int, dict[str, Any]]:
    """data_state.json's per-rank states by data-parallel rank (tensor-parallel peers save the
    same one), every rank of the saved layout present; one line for a file that is not what
    we write."""
    if not isinstance(states, list):
        raise DataError("data_state.json: not a list of per-rank data-loader states")
    saved: dict[int, dict[str, Any]] = {}
    for number, state in enumerate(states):
        if not state:
            continue
        fields = STATE_FIELDS.get(state.get("version")) if isinstance(state, dict) else None
        if fields is not None and any(field not in state for field in fields):
            fields = None
        if fields is None or not isinstance(state["dp_rank"], int):
            raise DataError(
                f"data_state.json: entry {number} is not a data-loader state this del-megatron "
                "reads: resume from another checkpoint"
            )
        saved.setdefault(state["dp_rank"], state)
    if saved:
        dp_size = saved[min(saved)]["dp_size"]
        missing = [r for r in range(dp_size) if r not in saved]
        if missing:
            raise DataError(
                f"data_state.json has no data-loader state of data-parallel rank {missing[0]} "
                f"(of {dp_size}): the checkpoint is incomplete; resume from another"
            )
    return saved


def check_resumable(
    states: list[dict[str, Any] | None], dp_size: int, num_workers: int, sources: int
) -> None:
    """The refusals StreamingLoader.resume would make for these saved per-rank states, made
    before anything starts: preflight runs it, so a dry run catches them."""
    for state in states_by_rank(states).values():
        refusal = resume_refusal(state, dp_size, num_workers, sources)
        if refusal:
            raise DataError(refusal)


@dataclass
class Segment:
    """The stretch of a run since its last change of layout or data mix: per source, the
    epoch its readers started in and the documents taken per epoch before it (cursor.py);
    batch_limit: batches per slot until the end of finite epochs (None: streaming); id: names
    it in the trace (the same for every pass over it); follows: the segment it continued and
    the batches each of that segment's ranks had consumed."""

    number: int
    start: list[int]
    taken: list[dict[int, np.ndarray]]
    batch_limit: int | None = None
    id: str = "0"
    follows: dict[str, Any] | None = None

    def taken_text(self) -> list[dict[str, str]]:
        return [{str(e): encode(t) for e, t in per.items()} for per in self.taken]


def load_manifests(
    cfg: DataConfig, fingerprint: str | None = None, *, check_shards: bool = False
) -> list[tuple[str, Manifest]]:
    """Every source's manifest; all must share one tokenizer, `fingerprint` if given.
    check_shards: also that every local shard listed is there at its size (preflight)."""
    manifests = []
    for source in cfg.sources:
        manifest = read_manifest(source.manifest, allow_pipe=cfg.allow_pipe)
        if check_shards:
            check_listed_shards(source.manifest, manifest)
        want = fingerprint or (manifests[0][1].tokenizer.fingerprint if manifests else None)
        if want is not None and manifest.tokenizer.fingerprint != want:
            raise DataError(
                f"{source.manifest}: shards were tokenized with tokenizer "
                f"{manifest.tokenizer.fingerprint[:18]}... ({manifest.tokenizer.source}), "
                f"training uses {want[:18]}...; rebuild the shards with the training tokenizer"
            )
        manifests.append((source.manifest, manifest))
    return manifests


def _to_batch(windows, state: dict[str, Any], logical: int) -> dict[str, Any]:
    tokens = torch.from_numpy(windows.tokens.astype(np.int64))
    mask = torch.from_numpy(windows.mask[:, 1:].astype(np.float32))
    return {
        "tokens": tokens[:, :-1],  # [b, s]
        "labels": tokens[:, 1:],  # [b, s], labels[:, t] is the target after tokens[:, t]
        "loss_mask": mask,  # [b, s] float, 0 on padding and prompt targets
        "worker": logical,
        "worker_state": state,
        "documents": windows.documents,
    }


def _plain(value: Any) -> Any:
    """Arrays to lists, so the state is plain data (JSON, torch.load weights_only). Worker
    processes hand numpy arrays over as tensors (DataLoader's default_convert)."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class _WorkerStreams(torch.utils.data.IterableDataset):
    """In each DataLoader worker (or the main process): the logical workers it serves."""

    def __init__(self, loader: StreamingLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        physical = info.id if info is not None else 0
        loader = self.loader
        workers = max(loader.cfg.num_workers, 1)
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
                yield _to_batch(windows, stream.state_dict(), logical)


def _worker_errors_as_one_line(batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
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

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        dataset = _WorkerStreams(self)
        if self.cfg.num_workers:
            source = iter(
                torch.utils.data.DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.cfg.num_workers,
                    persistent_workers=False,
                    multiprocessing_context="fork",
                )
            )
        else:
            source = iter(dataset)
        with contextlib.ExitStack() as stack:
            trace = stack.enter_context(open(self.trace, "a")) if self.trace else None
            if trace is not None:
                segment = self.segment
                trace.write(
                    start_line(
                        segment.id, self.dp_rank, self.consumed, segment.follows, time.time_ns()
                    )
                )
                trace.flush()
            for batch in _worker_errors_as_one_line(source):
                if self.num_batches is not None and self.consumed >= self.num_batches:
                    return
                self.worker_states[batch.pop("worker")] = batch.pop("worker_state")
                documents = batch.pop("documents")
                self.consumed += 1
                self.offset = self.consumed % self.workers
                if trace is not None:  # before the caller trains on it: a kill loses nothing
                    line = batch_line(
                        self.segment.id, self.dp_rank, self.consumed, _plain(documents)
                    )
                    trace.write(line)
                    trace.flush()
                yield batch

    # ---- resume -----------------------------------------------------------------------

    def _mix(self) -> list[dict[str, Any]]:
        return [
            {"manifest": url, "fingerprint": cursor.fingerprint(manifest), "weight": src.weight}
            for (url, manifest), src in zip(self.manifests, self.cfg.sources, strict=True)
        ]

    def _settings(self) -> dict[str, Any]:
        """What, besides the layout and the mix, a state's positions are relative to."""
        c = self.cfg
        return {
            "seed": c.seed,
            "shuffle": c.shuffle,
            "seq_len": c.seq_len,
            "micro_batch_size": c.micro_batch_size,
            "epochs": c.epochs,
        }

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
            "workers": {str(k): _plain(v) for k, v in self.worker_states.items()},
            "mix": self._mix(),
            "settings": self._settings(),
            "segment": {
                "number": self.segment.number,
                "id": self.segment.id,
                "follows": self.segment.follows,
                "start": list(self.segment.start),
                "batch_limit": self.segment.batch_limit,
                # large, and the same on every rank: kept once (empty ones everywhere)
                "taken": (
                    self.segment.taken_text()
                    if self.dp_rank == 0 or not any(self.segment.taken)
                    else None
                ),
            },
        }

    def load_state_dict(self, state: dict[str, Any], taken: list[dict[str, str]] | None = None):
        """Continue exactly from this rank's own state at the layout it was saved with.
        taken: the segment's taken sets when `state` is not data-parallel rank 0's."""
        if state.get("version") not in READABLE_VERSIONS:
            raise DataError(resume_refusal(state, self.dp_size, self.workers, len(self.manifests)))
        for field, mine in (
            ("dp_size", self.dp_size),
            ("num_workers", self.workers),
            ("dp_rank", self.dp_rank),
        ):
            if state[field] != mine:
                raise DataError(
                    f"data-loader state was saved with {field}={state[field]}, "
                    f"this loader has {field}={mine}"
                )
        self.consumed = state["consumed"]
        self.offset = self.consumed % self.workers
        self.worker_states = {int(k): v for k, v in state["workers"].items()}
        if state["version"] == 1:
            return
        segment = state["segment"]
        taken = segment["taken"] if segment["taken"] is not None else taken
        if taken is None:
            raise DataError(
                "this data-loader state keeps its taken documents with data-parallel rank 0's: "
                "resume from the list of every rank's state (StreamingLoader.resume)"
            )
        self.segment = Segment(
            segment["number"],
            list(segment["start"]),
            self._decode_taken(taken),
            segment["batch_limit"],
            segment["id"],
            segment["follows"],
        )

    def _decode_taken(self, taken: list[dict[str, str]]) -> list[dict[int, np.ndarray]]:
        return [
            {int(e): cursor.decode(text, manifest.documents) for e, text in per.items()}
            for per, (_, manifest) in zip(taken, self.manifests, strict=True)
        ]

    def resume(self, states: list[dict[str, Any] | None]) -> str:
        """Continue from a checkpoint's per-rank states (data_state.json: one per global rank,
        tensor-parallel peers alike) whatever layout and data mix they were saved with.
        Returns one line saying what changed ('' when nothing did)."""
        saved = states_by_rank(states)
        if not saved:
            return ""
        first = saved[min(saved)]
        refusal = resume_refusal(first, self.dp_size, self.workers, len(self.manifests))
        if refusal:
            raise DataError(refusal)
        if first["version"] == 1:
            self.load_state_dict(saved[self.dp_rank])
            return ""
        changes = self._changes(first)
        if not changes:
            self.load_state_dict(saved[self.dp_rank], saved[0]["segment"]["taken"])
            return ""
        # as many slots, the same mix and settings: each slot keeps its stream. Not with finite
        # epochs: slots have made unequal batch counts, so ranks would be left with different
        # counts to the end (one would stop while the others wait in a collective)
        same_slots = first["dp_size"] * first["num_workers"] == self.slots
        unchanged = first["mix"] == self._mix() and first["settings"] == self._settings()
        if same_slots and unchanged and self.cfg.epochs is None:
            self._continue_slots(saved)
            left = "every loader slot continues its own stream (data parallel x workers unchanged)"
        else:
            left = self._reshard(saved)
        return "data: " + "; ".join([*changes, left] if left else changes)

    def _next_segment(
        self, saved: dict[int, dict[str, Any]], start: list[int], taken: list[dict[int, Any]]
    ) -> Segment:
        """The segment after the saved one: it follows it from the batches each of its ranks
        had consumed (the trace cuts what a kill lost there), named by what it continues and
        how it reads."""
        segment = saved[0]["segment"]
        follows = {
            "segment": segment["id"],
            "consumed": {str(r): saved[r]["consumed"] for r in range(saved[0]["dp_size"])},
        }
        name = json.dumps([follows, self.dp_size, self.workers, self._mix(), self._settings()])
        return Segment(
            segment["number"] + 1,
            start,
            taken,
            id=hashlib.sha256(name.encode()).hexdigest()[:12],
            follows=follows,
        )

    def _continue_slots(self, saved: dict[int, dict[str, Any]]) -> None:
        """Another data-parallel size and worker count with as many slots as before
        (dp x workers), the mix and settings unchanged: slot s keeps its stream, so the run
        reads the documents in the order an unchanged run would. A new segment (for the
        trace) over the same plan: the old segment's start and taken sets."""
        first = saved[0]
        old_workers, segment = first["num_workers"], first["segment"]
        self.segment = self._next_segment(
            saved, list(segment["start"]), self._decode_taken(segment["taken"])
        )
        self.segment.batch_limit = segment["batch_limit"]
        self.worker_states = {}
        for worker in range(self.workers):
            rank, old_worker = divmod(self.slot(worker), old_workers)
            state = saved[rank]["workers"].get(str(old_worker))
            if state is not None:  # else that slot had not made a batch yet: it starts fresh
                self.worker_states[worker] = state
        self.consumed = self.offset = 0

    def _changes(self, saved: dict[str, Any]) -> list[str]:
        """What differs between a saved state and this loader, in words (empty: nothing)."""
        changes = []
        if saved["dp_size"] != self.dp_size:
            changes.append(f"data-parallel size {saved['dp_size']} -> {self.dp_size}")
        if saved["num_workers"] != self.workers:
            changes.append(f"loader workers {saved['num_workers']} -> {self.workers}")
        old = [(m["manifest"], m["fingerprint"]) for m in saved["mix"]]
        mix = self._mix()
        for i, now in enumerate(mix):
            key = (now["manifest"], now["fingerprint"])
            if key not in old:
                rebuilt = any(url == now["manifest"] for url, _ in old)
                what = "its manifest changed" if rebuilt else "added"
                changes.append(f"source {now['manifest']} {what}: starts at its beginning")
                continue
            before = saved["mix"][old.index(key)]
            if before["weight"] != now["weight"]:
                changes.append(
                    f"source {now['manifest']} weight {before['weight']} -> {now['weight']}"
                )
            if old.index(key) != i:
                changes.append(f"source {now['manifest']} moved in data.sources")
        new = [(m["manifest"], m["fingerprint"]) for m in mix]
        changes += [f"source {url} removed" for url, fp in old if (url, fp) not in new]
        for name, value in self._settings().items():
            if saved["settings"][name] != value:
                changes.append(f"{name} {saved['settings'][name]} -> {value}")
        return changes

    def _reshard(self, saved: dict[int, dict[str, Any]]) -> str:
        """Start a new segment from states saved at another layout or mix: every document any
        old slot took is taken, the new slots split the rest, and the old slots' partly packed
        windows go to new slot (old slot % new slots), in order. Returns what is left, in
        words."""
        first = saved[0]
        old_workers, old_dp = first["num_workers"], first["dp_size"]
        old_slots = old_dp * old_workers
        settings, segment = first["settings"], first["segment"]
        old_keys = [(m["manifest"], m["fingerprint"]) for m in first["mix"]]
        slot_states: list[dict[str, Any] | None] = [None] * old_slots
        for rank in range(old_dp):
            for worker, state in saved[rank]["workers"].items():
                slot_states[rank * old_workers + int(worker)] = state
        skipped: list[str] = []
        for state in slot_states:
            skipped += [n for n in (state or {}).get("skipped", []) if n not in skipped]

        start, taken, left = [], [], []
        for url, manifest in self.manifests:
            key = (url, cursor.fingerprint(manifest))
            if key not in old_keys:
                start.append(0)
                taken.append({})
                continue
            index = old_keys.index(key)
            before = {
                int(e): cursor.decode(text, manifest.documents)
                for e, text in segment["taken"][index].items()
            }
            positions = [
                state["readers"][index] if state else {"epoch": segment["start"][index]}
                for state in slot_states
            ]
            unreadable = [
                _shard_indices(url, manifest, (state or {}).get("skipped", []))
                for state in slot_states
            ]
            order = cursor.Order(settings["seed"], settings["shuffle"], index)
            epoch, per_epoch = _taken_after(
                manifest, order, before, positions, unreadable, old_slots
            )
            start.append(epoch)
            taken.append(per_epoch)
            if epoch in per_epoch:
                rest = int((~per_epoch[epoch]).sum())
                left.append(f"{url} continues with {rest} documents left of epoch {epoch}")
            else:
                left.append(f"{url} continues at the start of epoch {epoch}")

        handed = _hand_over(slot_states, self.slots)
        same_mix = [m for m in first["mix"]] == self._mix()
        drawn = [0] * len(self.manifests)
        if same_mix:  # the mix goes on; after a change it starts again at the new weights
            for state in slot_states:
                for i, tokens in enumerate((state or {}).get("drawn", [])):
                    drawn[i] += tokens
            drawn = [d // self.slots for d in drawn]
        self.segment = self._next_segment(saved, start, taken)
        self.segment.batch_limit = self._batches_per_worker(
            self.segment, [len(tokens) for tokens, _, _ in handed]
        )
        self.worker_states = {}
        for worker in range(self.workers):
            tokens, mask, docs = handed[self.slot(worker)]
            self.worker_states[worker] = {
                "version": STATE_VERSION,
                "readers": [{"epoch": e} for e in start],
                "drawn": list(drawn),
                "exhausted": [False] * len(self.manifests),
                "pending_tokens": tokens,
                "pending_mask": mask,
                "pending_docs": docs,
                "batches": 0,
                "skipped": list(skipped),
            }
        self.consumed = self.offset = 0
        return "; ".join(left)

    @property
    def skipped_shards(self) -> list[str]:
        names: list[str] = []
        for state in self.worker_states.values():
            names += [n for n in state["skipped"] if n not in names]
        return names


def _shard_indices(url: str, manifest: Manifest, locations: list[str]) -> set[int]:
    """Indices of the shards of a source at these locations (a slot's skipped list)."""
    wanted = set(locations)
    return {i for i, e in enumerate(manifest.shards) if resolve(url, e.name) in wanted}


def _taken_after(
    manifest: Manifest,
    order: cursor.Order,
    before: dict[int, np.ndarray],
    positions: list[dict[str, int]],
    unreadable: list[set[int]],
    slots: int,
) -> tuple[int, dict[int, np.ndarray]]:
    """Where a source stands after a segment: the first epoch with documents left and, per
    epoch from it that some slot had reached, the documents taken (only epochs with some).
    before: taken at the segment's start; positions[k]: old slot k's reader position."""
    reached = [p["epoch"] for p in positions]
    epochs: dict[int, np.ndarray] = {}
    # up to the last epoch with documents taken, also one no slot has reached in this
    # segment (taken before it by a slot that was ahead)
    for epoch in range(min(reached), max([*reached, *before]) + 1):
        taken = before.get(epoch, np.zeros(manifest.documents, bool)).copy()
        prior = before.get(epoch)
        streams: dict = {}  # one striding document stream per epoch, shared by the slots
        for slot, (position, skipped) in enumerate(zip(positions, unreadable, strict=True)):
            if epoch < position["epoch"]:  # that slot finished its part of the epoch
                done = cursor.read_prefix(
                    manifest, order, epoch, prior, slot, slots, None, skipped, streams
                )
            elif epoch == position["epoch"] and "shard_pos" in position:
                done = cursor.read_prefix(
                    manifest, order, epoch, prior, slot, slots, position, skipped, streams
                )
            else:
                continue
            taken[done] = True
        epochs[epoch] = taken
    first = min(reached)
    while first in epochs and epochs[first].all():
        del epochs[first]
        first += 1
    return first, {e: t for e, t in epochs.items() if t.any()}


def _hand_over(
    slot_states: list[dict[str, Any] | None], slots: int
) -> list[tuple[list[int], list[int], list[list[Any]]]]:
    """The partly packed windows of the old slots for each new slot: old slot k goes to new
    slot k % slots, in order; the token every window after the first starts with was already
    trained on (the last of the old slot's last window) and is left out."""
    handed: list[tuple[list[int], list[int], list[list[Any]]]] = [
        ([], [], []) for _ in range(slots)
    ]
    for k, state in enumerate(slot_states):
        if not state or len(state["pending_tokens"]) == 0:
            continue
        tokens, mask, docs = handed[k % slots]
        pending_docs = state["pending_docs"]
        overlap = len(state["pending_tokens"]) - sum(d[-1] for d in pending_docs)
        drop = overlap if tokens else 0
        tokens += list(state["pending_tokens"][drop:])
        mask += list(state["pending_mask"][drop:])
        docs += [list(d) for d in pending_docs]
    return handed
