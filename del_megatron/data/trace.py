"""The trace of trained documents (`data.trace`): written by the loader as it hands batches
to training, read by tests to check that a run trained every document once across resumes.

One JSON-lines file per data-parallel rank. Each pass over the loader first writes a *start*
line, then one *batch* line per batch:

    {"segment": ID, "dp_rank": r, "start": c, "follows": {"segment": ID0, "consumed": {r0: c0}}
     | null, "time_ns": t}
    {"segment": ID, "dp_rank": r, "consumed": c, "documents": [[manifest, epoch, shard,
     sample, tokens], ...]}

A segment is the stretch of a run between changes of layout or data mix; `follows` names
the segment it continued and how many batches each of that segment's ranks had consumed at
the checkpoint it resumed from. Batch lines are written before the batch is trained on, so a
kill leaves lines of batches whose training the checkpoint does not hold; `trained` drops
them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .state import plain

DocumentId = tuple[str, int, int, int]  # manifest, epoch, shard, sample


class Traceable(Protocol):
    @property
    def documents(self) -> list[list[Any]]: ...  # [manifest, epoch, shard, sample, tokens]


Item = TypeVar("Item", bound=Traceable)


def traced(
    items: Iterator[Item],
    path: str,
    segment: str,
    dp_rank: int,
    start: int,
    follows: dict[str, Any] | None,
) -> Iterator[Item]:
    """Hands on `items` (batches about to be trained on, each with the documents whose tokens
    it trains), appending to `path` a start line and then one batch line per item before
    handing it on: a kill during its training loses nothing. start: batches of the segment
    consumed before these."""
    with open(path, "a") as trace:
        trace.write(start_line(segment, dp_rank, start, follows, time.time_ns()))
        trace.flush()
        consumed = start
        for item in items:
            consumed += 1
            trace.write(batch_line(segment, dp_rank, consumed, plain(item.documents)))
            trace.flush()
            yield item


def start_line(
    segment: str, dp_rank: int, start: int, follows: dict[str, Any] | None, time_ns: int
) -> str:
    line = {
        "segment": segment,
        "dp_rank": dp_rank,
        "start": start,
        "follows": follows,
        "time_ns": time_ns,
    }
    return json.dumps(line) + "\n"


def batch_line(segment: str, dp_rank: int, consumed: int, documents: list[list[Any]]) -> str:
    line = {"segment": segment, "dp_rank": dp_rank, "consumed": consumed, "documents": documents}
    return json.dumps(line) + "\n"


def trained(directory: str | Path) -> Counter[DocumentId]:
    """Tokens trained per document over the run whose trace is in `directory`: the segments
    from the newest start back along `follows`; in each, the batches a later pass or segment
    continued from, not those a kill lost."""
    starts: list[dict[str, Any]] = []
    kept: dict[tuple[str, int], dict[int, list[list[Any]]]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        for text in path.read_text().splitlines():
            line = json.loads(text)
            key = (line["segment"], line["dp_rank"])
            batches = kept.setdefault(key, {})
            if "start" in line:  # a resume: what this rank consumed after it is void
                starts.append(line)
                for consumed in [c for c in batches if c > line["start"]]:
                    del batches[consumed]
            else:
                batches[line["consumed"]] = line["documents"]
    if not starts:
        return Counter()
    parents = {line["segment"]: line["follows"] for line in starts}
    segment: str | None = max(starts, key=lambda line: line["time_ns"])["segment"]
    cut: dict[int, int] | None = None  # per rank: batches the next segment continued from
    counts: Counter[DocumentId] = Counter()
    while segment is not None:
        for (name, rank), batches in kept.items():
            if name != segment:
                continue
            for consumed, documents in batches.items():
                if cut is not None and consumed > cut.get(rank, 0):
                    continue
                for manifest, epoch, shard, sample, tokens in documents:
                    counts[(manifest, epoch, shard, sample)] += tokens
        follows = parents.get(segment)
        if follows is None:
            break
        segment = follows["segment"]
        cut = {int(rank): c for rank, c in follows["consumed"].items()}
    return counts
