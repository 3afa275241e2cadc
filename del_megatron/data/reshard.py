"""Resharding a saved loader state: what changed, and the new segment (pure arithmetic).

Given every rank's saved state (state.py) and the loader about to continue it: the typed
changes of layout, mix and settings; per source the first epoch with documents left and the
documents taken in each epoch some old slot had reached (the old taken sets plus every old
slot's prefix of its plan, cursor.py); and the old slots' partly packed windows, handed to the
new slots. No I/O, no loader: arguments in, records out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from . import cursor
from .format import Manifest, resolve
from .state import RankState, SavedState
from .stream import STATE_VERSION


@dataclass(frozen=True)
class SourceChange:
    """One source's change between the saved mix and this one."""

    manifest: str
    kind: Literal["added", "rebuilt", "reweighted", "moved", "removed"]
    weight: tuple[float, float] | None = None  # (saved, now) when reweighted

    def line(self) -> str:
        if self.kind == "added":
            return f"source {self.manifest} added: starts at its beginning"
        if self.kind == "rebuilt":
            return f"source {self.manifest} its manifest changed: starts at its beginning"
        if self.kind == "reweighted":
            assert self.weight is not None
            return f"source {self.manifest} weight {self.weight[0]} -> {self.weight[1]}"
        if self.kind == "moved":
            return f"source {self.manifest} moved in data.sources"
        return f"source {self.manifest} removed"


@dataclass(frozen=True)
class Changes:
    """What differs between a saved state and the loader continuing it. False when nothing
    does: the loader continues the saved segment at the saved layout."""

    old_slots: int
    new_slots: int
    dp_size: tuple[int, int] | None  # (saved, now) when changed
    workers: tuple[int, int] | None
    sources: tuple[SourceChange, ...]
    settings: tuple[tuple[str, Any, Any], ...]  # (name, saved, now)
    same_mix: bool  # the saved mix is exactly this one (sources, order, weights)

    def __bool__(self) -> bool:
        return bool(self.dp_size or self.workers or self.sources or self.settings)

    @property
    def same_slots(self) -> bool:
        """As many slots (data parallel x workers) as before."""
        return self.old_slots == self.new_slots

    @property
    def same_plan(self) -> bool:
        """The same mix and settings: only the layout differs."""
        return self.same_mix and not self.settings

    def lines(self) -> list[str]:
        out = []
        if self.dp_size:
            out.append(f"data-parallel size {self.dp_size[0]} -> {self.dp_size[1]}")
        if self.workers:
            out.append(f"loader workers {self.workers[0]} -> {self.workers[1]}")
        out += [change.line() for change in self.sources]
        out += [f"{name} {old} -> {now}" for name, old, now in self.settings]
        return out


def changes(
    saved: RankState,
    dp_size: int,
    workers: int,
    mix: list[dict[str, Any]],
    settings: dict[str, Any],
) -> Changes:
    """What differs between a saved rank's state (version 2) and a loader of this layout,
    mix (state.mix_of) and settings (state.settings_of)."""
    old = [(m["manifest"], m["fingerprint"]) for m in saved.mix]
    sources: list[SourceChange] = []
    for i, now in enumerate(mix):
        key = (now["manifest"], now["fingerprint"])
        if key not in old:
            rebuilt = any(url == now["manifest"] for url, _ in old)
            sources.append(SourceChange(now["manifest"], "rebuilt" if rebuilt else "added"))
            continue
        before = saved.mix[old.index(key)]
        if before["weight"] != now["weight"]:
            weight = (before["weight"], now["weight"])
            sources.append(SourceChange(now["manifest"], "reweighted", weight))
        if old.index(key) != i:
            sources.append(SourceChange(now["manifest"], "moved"))
    new = [(m["manifest"], m["fingerprint"]) for m in mix]
    sources += [SourceChange(url, "removed") for url, fp in old if (url, fp) not in new]
    return Changes(
        old_slots=saved.dp_size * saved.num_workers,
        new_slots=dp_size * workers,
        dp_size=(saved.dp_size, dp_size) if saved.dp_size != dp_size else None,
        workers=(saved.num_workers, workers) if saved.num_workers != workers else None,
        sources=tuple(sources),
        settings=tuple(
            (name, saved.settings[name], value)
            for name, value in settings.items()
            if saved.settings[name] != value
        ),
        same_mix=saved.mix == mix,
    )


@dataclass
class Resharded:
    """The start of the segment after a change: per source the epoch its readers start in and
    the documents taken per epoch (only epochs with some); per new slot its stream's state;
    left: per source, what is left, in words."""

    start: list[int]
    taken: list[dict[int, np.ndarray]]
    slot_states: list[dict[str, Any]]
    left: list[str]


def reshard(
    saved: SavedState,
    manifests: list[tuple[str, Manifest]],
    slots: int,
    same_mix: bool,
) -> Resharded:
    """The new segment from states saved at another layout or mix: every document any old slot
    took is taken, the new slots split the rest, and the old slots' partly packed windows go to
    new slot (old slot % new slots), in order."""
    settings, segment = saved.first.settings, saved.segment
    old_keys = [(m["manifest"], m["fingerprint"]) for m in saved.first.mix]
    slot_states = saved.slot_states()
    assert segment.taken is not None  # rank 0's state keeps them
    old_slots = len(slot_states)
    skipped: list[str] = []
    for state in slot_states:
        skipped += [n for n in (state or {}).get("skipped", []) if n not in skipped]

    start, taken, left = [], [], []
    for url, manifest in manifests:
        key = (url, cursor.fingerprint(manifest))
        if key not in old_keys:
            start.append(0)
            taken.append({})
            continue
        index = old_keys.index(key)
        before = {
            int(e): cursor.decode(text, manifest.documents)
            for e, text in segment.taken[index].items()
        }
        positions = [
            state["readers"][index] if state else {"epoch": segment.start[index]}
            for state in slot_states
        ]
        unreadable = [
            shard_indices(url, manifest, (state or {}).get("skipped", [])) for state in slot_states
        ]
        order = cursor.Order(settings["seed"], settings["shuffle"], index)
        epoch, per_epoch = taken_after(manifest, order, before, positions, unreadable, old_slots)
        start.append(epoch)
        taken.append(per_epoch)
        if epoch in per_epoch:
            rest = int((~per_epoch[epoch]).sum())
            left.append(f"{url} continues with {rest} documents left of epoch {epoch}")
        else:
            left.append(f"{url} continues at the start of epoch {epoch}")

    drawn = [0] * len(manifests)
    if same_mix:  # the mix goes on; after a change it starts again at the new weights
        for state in slot_states:
            for i, tokens in enumerate((state or {}).get("drawn", [])):
                drawn[i] += tokens
        drawn = [d // slots for d in drawn]
    fresh = [
        {
            "version": STATE_VERSION,
            "readers": [{"epoch": e} for e in start],
            "drawn": list(drawn),
            "exhausted": [False] * len(manifests),
            "pending_tokens": tokens,
            "pending_mask": mask,
            "pending_docs": docs,
            "batches": 0,
            "skipped": list(skipped),
        }
        for tokens, mask, docs in hand_over(slot_states, slots)
    ]
    return Resharded(start, taken, fresh, left)


def shard_indices(url: str, manifest: Manifest, locations: list[str]) -> set[int]:
    """Indices of the shards of a source at these locations (a slot's skipped list)."""
    wanted = set(locations)
    return {i for i, e in enumerate(manifest.shards) if resolve(url, e.name) in wanted}


def taken_after(
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
        cache: dict = {}  # what is the same for every slot of the epoch (cursor.read_prefix)
        for slot, (position, skipped) in enumerate(zip(positions, unreadable, strict=True)):
            if epoch < position["epoch"]:  # that slot finished its part of the epoch
                done = cursor.read_prefix(
                    manifest, order, epoch, prior, slot, slots, None, skipped, cache
                )
            elif epoch == position["epoch"] and "shard_pos" in position:
                done = cursor.read_prefix(
                    manifest, order, epoch, prior, slot, slots, position, skipped, cache
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


def hand_over(
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
