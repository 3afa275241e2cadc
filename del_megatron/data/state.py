"""The loader's saved state: its format, the versions read, and the refusals.

A rank's state (StreamingLoader.state_dict) says what the training loop consumed: per loader
worker its stream's position (stream.py), plus the segment (the taken sets at its start,
cursor.py), the mix and the settings the positions are relative to. A checkpoint's
data_state.json (saved_file, FILE_VERSION 3) holds what is the same on every rank once (the
layout, mix, settings and segment with its taken sets) and one record per data-parallel rank
(rank_record); before it, it was the list of every global rank's state (tensor-parallel peers
alike), which read_saved reads too. Everything here is plain data (JSON, torch.load
weights_only) and pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from . import cursor
from .config import DataConfig
from .format import DataError, Manifest

LOADER_STATE_VERSION = 2  # 2: the segment's taken sets, the mix and order; any layout
READABLE_VERSIONS = (1, 2)

STATE_FIELDS = {  # what a per-rank state of each version holds at its top level
    1: ("dp_rank", "dp_size", "num_workers", "consumed", "workers"),
    2: ("dp_rank", "dp_size", "num_workers", "consumed", "workers", "segment", "mix", "settings"),
}


def version_refusal(version: Any) -> str:
    """Why a state of this version cannot be read ('' if it can), naming the fix."""
    if version in READABLE_VERSIONS:
        return ""
    return (
        f"its data-loader state has version {version}, this del-megatron reads "
        f"{' and '.join(map(str, READABLE_VERSIONS))}: resume with the del-megatron that "
        "wrote it"
    )


@dataclass(frozen=True)
class SavedSegment:
    """The segment a state was saved in, as saved (Segment is the live one); taken: its taken
    sets as text, per source of the saved mix (in a rank's state_dict(), None but in
    data-parallel rank 0's when not empty; in a SavedState every rank holds rank 0's)."""

    number: int
    id: str
    follows: dict[str, Any] | None
    start: list[int]
    batch_limit: int | None
    taken: list[dict[str, str]] | None


@dataclass(frozen=True)
class RankState:
    """One data-parallel rank's saved state (tensor-parallel peers save the same one).
    workers: per logical worker, its slot stream's state (stream.py's format); mix, settings
    and segment: what the positions are relative to (version 2; empty in version 1)."""

    version: int
    dp_rank: int
    dp_size: int
    num_workers: int
    consumed: int
    workers: dict[int, dict[str, Any]]
    mix: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    segment: SavedSegment | None = None

    @classmethod
    def parse(cls, state: Any, what: str) -> RankState:
        """A per-rank state as state_dict() writes it; one line naming `what` it is (in
        data_state.json) for anything else."""
        try:
            saved = {name: state[name] for name in STATE_FIELDS[state["version"]]}
            if not isinstance(saved["dp_rank"], int):
                raise TypeError("dp_rank")
            if state["version"] != 1:
                saved["segment"] = SavedSegment(**saved["segment"])
            saved["workers"] = {int(k): v for k, v in saved["workers"].items()}
            return cls(version=state["version"], **saved)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise DataError(
                f"data_state.json: {what} is not a data-loader state this del-megatron reads: "
                "resume from another checkpoint"
            ) from None


@dataclass(frozen=True)
class SavedState:
    """A checkpoint's data state: one record per data-parallel rank of the layout it was
    saved at (ranks[r] is rank r's), and the segment they were in with its taken sets (kept
    once, by rank 0)."""

    ranks: tuple[RankState, ...]

    @property
    def first(self) -> RankState:
        return self.ranks[0]

    @property
    def segment(self) -> SavedSegment:
        assert self.first.segment is not None  # version 2
        return self.first.segment

    @property
    def slots(self) -> int:
        return self.first.dp_size * self.first.num_workers

    def slot_states(self) -> list[dict[str, Any] | None]:
        """Every old slot's stream state (None: that slot had not made a batch), slot order."""
        states: list[dict[str, Any] | None] = [None] * self.slots
        for rank in self.ranks:
            for worker, state in rank.workers.items():
                states[rank.dp_rank * rank.num_workers + worker] = state
        return states

    def consumed(self) -> dict[str, int]:
        """Batches each rank had consumed, by rank (as the trace names them)."""
        return {str(rank.dp_rank): rank.consumed for rank in self.ranks}


def resume_refusal(state: RankState, dp_size: int, num_workers: int, sources: int) -> str:
    """Why a saved per-rank state cannot be resumed by a loader of this layout ('' if it can):
    one sentence naming the fix. A version 2 state continues at any layout and data mix; a
    version 1 state (saved before the cursor resharded) only at its own."""
    if state.version != 1:
        return version_refusal(state.version)
    workers = max(num_workers, 1)
    if state.dp_size != dp_size:
        return (
            f"its data-loader state (version 1, written before the data cursor could change "
            f"layout) was saved at data-parallel size {state.dp_size}, this run has "
            f"{dp_size}: resume at data-parallel size {state.dp_size} (world size / "
            "parallel.tensor_parallel), then any later checkpoint resumes at any layout"
        )
    if state.num_workers != workers:
        return (
            f"its data-loader state was saved with data.num_workers={state.num_workers}"
            f", this run has {workers}: resume with data.num_workers={state.num_workers}"
        )
    for worker in state.workers.values():
        saved = len(worker.get("readers", []))
        if saved != sources:
            return (
                f"its data-loader state has {saved} sources and data.sources has {sources}: "
                "resume with the data.sources it was saved with (its run_config.yaml), or start "
                "a new run in another output_dir"
            )
    return ""


FILE_VERSION = 3  # data_state.json as one record: the segment once, a record per dp rank
RANK_FIELDS = ("dp_rank", "consumed", "workers")  # what is each data-parallel rank's own
NO_LOADER = {"version": FILE_VERSION, "ranks": []}  # a run fed by its caller (no loader)


def rank_record(state: dict[str, Any]) -> dict[str, Any]:
    """The part of a rank's state_dict() that is its own: its data-parallel rank, the batches
    it consumed and its workers' stream states (the layout, mix, settings and segment are the
    same on every rank; saved_file takes them once, from data-parallel rank 0's state)."""
    return {name: state[name] for name in RANK_FIELDS}


def saved_file(first: dict[str, Any] | None, records: list[dict[str, Any]]) -> dict[str, Any]:
    """data_state.json: the layout, mix, settings and the segment with its taken sets once,
    from data-parallel rank 0's state_dict() `first`, then one record per data-parallel rank
    (`records`: every rank's rank_record(), in rank order). first None: the run had no loader
    (NO_LOADER). read_saved reads it, and the list of per-rank states written before it."""
    if first is None:
        return dict(NO_LOADER)
    ranks = [rank_record(record) for record in records]
    if first.get("version") != LOADER_STATE_VERSION or first["segment"]["taken"] is None:
        raise ValueError("saved_file takes data-parallel rank 0's state_dict() of this loader")
    if [rank["dp_rank"] for rank in ranks] != list(range(first["dp_size"])):
        raise ValueError("saved_file takes one record per data-parallel rank, in rank order")
    return {
        "version": FILE_VERSION,
        "dp_size": first["dp_size"],
        "num_workers": first["num_workers"],
        "mix": first["mix"],
        "settings": first["settings"],
        "segment": first["segment"],
        "ranks": ranks,
    }


def _read_file(saved: dict[str, Any]) -> SavedState:
    """A data_state.json of FILE_VERSION."""
    try:
        segment = SavedSegment(**saved["segment"])
        ranks = tuple(
            RankState(
                version=LOADER_STATE_VERSION,
                dp_rank=rank["dp_rank"],
                dp_size=saved["dp_size"],
                num_workers=saved["num_workers"],
                consumed=rank["consumed"],
                workers={int(k): v for k, v in rank["workers"].items()},
                mix=saved["mix"],
                settings=saved["settings"],
                segment=segment,
            )
            for rank in saved["ranks"]
        )
        if [rank.dp_rank for rank in ranks] != list(range(saved["dp_size"])):
            raise ValueError("ranks")
        if segment.taken is None:
            raise ValueError("taken")
    except (KeyError, TypeError, ValueError, AttributeError):
        raise DataError(
            "data_state.json: not a data-loader state this del-megatron reads (a field is "
            "missing or not what we write): resume from another checkpoint"
        ) from None
    return SavedState(ranks)


def read_saved(states: Any) -> SavedState | None:
    """data_state.json as one record per data-parallel rank, every rank of the saved layout
    present (None: no loader state): a saved_file record, or the list of per-rank states (one
    per global rank: tensor-parallel peers save the same one) written before it; one line for
    a file that is not what we write. A SavedState, or None, is returned as it is (read
    already: checkpoint.data_state's answer)."""
    if states is None or isinstance(states, SavedState):
        return states  # read already (None: a checkpoint without loader state)
    if isinstance(states, dict) and "version" in states:
        if states == NO_LOADER:
            return None
        if states["version"] == FILE_VERSION:
            return _read_file(states)
        raise DataError(
            f"data_state.json has version {states['version']}, this del-megatron reads "
            f"{FILE_VERSION} and the list of per-rank states before it: resume with the "
            "del-megatron that wrote it"
        )
    if not isinstance(states, list):
        raise DataError("data_state.json: not a list of per-rank data-loader states")
    saved: dict[int, RankState] = {}
    for number, state in enumerate(states):
        if state:
            rank = RankState.parse(state, f"entry {number}")
            saved.setdefault(rank.dp_rank, rank)
    if not saved:
        return None
    dp_size = saved[min(saved)].dp_size
    missing = [r for r in range(dp_size) if r not in saved]
    if missing:
        raise DataError(
            f"data_state.json has no data-loader state of data-parallel rank {missing[0]} "
            f"(of {dp_size}): the checkpoint is incomplete; resume from another"
        )
    segment = saved[0].segment  # with its taken sets: rank 0's (None: version 1)
    return SavedState(tuple(replace(saved[r], segment=segment) for r in range(dp_size)))


def check_resumable(states: Any, dp_size: int, num_workers: int, sources: int) -> None:
    """The refusals StreamingLoader.resume would make for a saved data state (what read_saved
    reads, or its SavedState), made before anything starts: preflight runs it, so a dry run
    catches them."""
    saved = read_saved(states)
    for rank in saved.ranks if saved is not None else ():
        refusal = resume_refusal(rank, dp_size, num_workers, sources)
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
        return [{str(e): cursor.encode(t) for e, t in per.items()} for per in self.taken]

    def saved(self, with_taken: bool) -> dict[str, Any]:
        """As a state holds it; the taken sets (large, the same on every rank) only
        `with_taken` (data-parallel rank 0's, and empty ones everywhere)."""
        return {
            "number": self.number,
            "id": self.id,
            "follows": self.follows,
            "start": list(self.start),
            "batch_limit": self.batch_limit,
            "taken": self.taken_text() if with_taken or not any(self.taken) else None,
        }

    @classmethod
    def from_saved(cls, segment: SavedSegment, taken: list[dict[int, np.ndarray]]) -> Segment:
        return cls(
            segment.number,
            list(segment.start),
            taken,
            segment.batch_limit,
            segment.id,
            segment.follows,
        )


def decode_taken(
    taken: list[dict[str, str]], manifests: list[tuple[str, Manifest]]
) -> list[dict[int, np.ndarray]]:
    """A saved segment's taken sets, per source of `manifests` (the saved mix's order)."""
    return [
        {int(e): cursor.decode(text, manifest.documents) for e, text in per.items()}
        for per, (_, manifest) in zip(taken, manifests, strict=True)
    ]


def mix_of(cfg: DataConfig, manifests: list[tuple[str, Manifest]]) -> list[dict[str, Any]]:
    """The sources as a state records them: manifest, content fingerprint, weight."""
    return [
        {"manifest": url, "fingerprint": cursor.fingerprint(manifest), "weight": src.weight}
        for (url, manifest), src in zip(manifests, cfg.sources, strict=True)
    ]


def settings_of(cfg: DataConfig) -> dict[str, Any]:
    """What, besides the layout and the mix, a state's positions are relative to."""
    return {
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
        "seq_len": cfg.seq_len,
        "micro_batch_size": cfg.micro_batch_size,
        "epochs": cfg.epochs,
    }


def plain(value: Any) -> Any:
    """Arrays to lists, so the state is plain data (JSON, torch.load weights_only). Worker
    processes hand numpy arrays over as tensors (DataLoader's default_convert)."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
