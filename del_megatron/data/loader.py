"""The streaming loader: batches of packed windows for one data-parallel rank, resumable.

Tensor-parallel peers pass the same data-parallel rank and receive identical batches. With
workers, batch i comes from logical worker i % num_workers (torch's in-order round robin);
each batch carries its worker's state, so `state_dict()` describes exactly what the training
loop has consumed, prefetched batches excluded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .config import DataConfig
from .format import DataError, Manifest, check_listed_shards, read_manifest
from .stream import SlotStream, Windows, build_slot_stream

LOADER_STATE_VERSION = 1


def check_resumable(
    states: list[dict[str, Any] | None], dp_size: int, num_workers: int, sources: int
) -> None:
    """The refusals that StreamingLoader.load_state_dict (and its streams') would make when a
    run resumes these saved per-rank states, made before anything starts: preflight runs it,
    so a dry run catches them. Each DataError names the fix. States saved at another
    data-parallel size are not loaded position by position (consume_elsewhere): no refusal."""
    workers = max(num_workers, 1)
    for state in states:
        if not state:
            continue
        if state.get("version") != LOADER_STATE_VERSION:
            raise DataError(
                f"data-loader state version {state.get('version')} is not {LOADER_STATE_VERSION}"
            )
        if state.get("dp_size") != dp_size:
            return
        if state.get("num_workers") != workers:
            raise DataError(
                f"its data-loader state was saved with data.num_workers={state.get('num_workers')}"
                f", this run has {workers}: resume with data.num_workers="
                f"{state.get('num_workers')}"
            )
        for worker in state.get("workers", {}).values():
            saved = len(worker.get("readers", []))
            if saved != sources:
                raise DataError(
                    f"its data-loader state has {saved} sources and data.sources has {sources}:"
                    " resume with the data.sources it was saved with (its run_config.yaml), "
                    "or start a new run in another output_dir"
                )


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
    """

    def __init__(
        self,
        cfg: DataConfig,
        dp_rank: int = 0,
        dp_size: int = 1,
        *,
        fingerprint: str | None = None,
        num_batches: int | None = None,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside data-parallel size {dp_size}")
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.num_batches = num_batches
        self.manifests = load_manifests(cfg, fingerprint)
        self.workers = max(cfg.num_workers, 1)
        self.slots = dp_size * self.workers
        self.consumed = 0  # batches handed to the caller
        self.offset = 0  # logical worker of the next batch
        self.worker_states: dict[int, dict[str, Any]] = {}
        self.start_epoch = 0  # set by consume_elsewhere
        self.batch_limit = self._batches_per_worker()

    # ---- plan -------------------------------------------------------------------------

    def slot(self, logical_worker: int) -> int:
        return self.dp_rank * self.workers + logical_worker

    def make_stream(self, logical_worker: int) -> SlotStream:
        stream = build_slot_stream(self.cfg, self.manifests, self.slot(logical_worker), self.slots)
        if logical_worker in self.worker_states:
            stream.load_state_dict(self.worker_states[logical_worker])
        elif self.start_epoch:
            for reader in stream.readers:
                reader.position.epoch = self.start_epoch
        return stream

    def consume_elsewhere(self, states: list[dict[str, Any]], consumed_batches: int) -> None:
        """Continue from states saved with another data-parallel size or worker count.

        Positions do not map between layouts, so the stream resumes at the start of the
        epoch after the furthest one any saved slot had reached: nothing is read twice; the
        rest of the interrupted epoch is skipped.
        """
        furthest = 0
        for state in states:
            for worker in (state or {}).get("workers", {}).values():
                furthest = max([furthest, *(r["epoch"] for r in worker["readers"])])
        self.start_epoch = furthest + 1
        self.worker_states = {}
        self.consumed = 0
        self.offset = 0

    def _batches_per_worker(self) -> int | None:
        """With finite epochs: the most batches any slot of any rank needs (all pad to it)."""
        if self.cfg.epochs is None:
            return None
        s, b = self.cfg.seq_len, self.cfg.micro_batch_size
        most = 0
        for slot in range(self.slots):
            stream = build_slot_stream(self.cfg, self.manifests, slot, self.slots)
            tokens = sum(r.planned_tokens(self.cfg.epochs) for r in stream.readers)
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
        for batch in _worker_errors_as_one_line(source):
            if self.num_batches is not None and self.consumed >= self.num_batches:
                return
            self.worker_states[batch.pop("worker")] = batch.pop("worker_state")
            self.consumed += 1
            self.offset = self.consumed % self.workers
            yield batch

    # ---- resume -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What has been consumed: enough to continue with the next unseen window."""
        return {
            "version": LOADER_STATE_VERSION,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "num_workers": self.workers,
            "consumed": self.consumed,
            "workers": {str(k): _plain(v) for k, v in self.worker_states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise DataError(
                f"data-loader state version {state.get('version')} is not {LOADER_STATE_VERSION}"
            )
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

    @property
    def skipped_shards(self) -> list[str]:
        names: list[str] = []
        for state in self.worker_states.values():
            names += [n for n in state["skipped"] if n not in names]
        return names
