"""The data cursor across layouts: an epoch interrupted at a data-parallel size and worker
count change, twice, trains every document exactly once; the data mix may change on resume;
a state from before the cursor resharded is refused at another layout.

A run is simulated one segment at a time: every data-parallel rank takes the same number of
batches, the states are saved (as data_state.json: plain JSON), each rank goes on a few
batches more (trained, then lost: the kill comes after the checkpoint) and the next segment
resumes the saved states at another layout. The loaders' trace files say which document
tokens each batch trained; lines after the checkpoint a segment was resumed from are cut.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from data_tools.build import build_shards
from del_megatron.data import (
    DataConfig,
    DataError,
    DataSource,
    StreamingLoader,
    cursor,
    read_manifest,
    trace,
)
from del_megatron.data.format import read_shard, resolve
from del_megatron.data.state import check_resumable, saved_file


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, synth_tokenizer) -> dict[str, Path]:
    """'many': 300 documents in ~14 shards; 'few': 120 documents in 2 shards (striding once
    there are more slots than 2); 'other': a third source for mix changes."""
    root = tmp_path_factory.mktemp("reshard")
    rng = np.random.default_rng(1)
    manifests = {}
    for name, count, shard_kb in (("many", 300, 16), ("few", 120, 100), ("other", 150, 16)):
        lines = [
            json.dumps(
                {
                    "text": f"{name} "
                    + " ".join(str(x) for x in rng.integers(0, 10**6, rng.integers(3, 40)))
                }
            )
            for _ in range(count)
        ]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        build_shards(
            [root / f"{name}.jsonl"],
            root / name,
            synth_tokenizer,
            shard_bytes=shard_kb << 10,
            progress=False,
        )
        manifests[name] = root / name / "manifest.json"
    assert len(read_manifest(str(manifests["few"])).shards) == 2
    assert len(read_manifest(str(manifests["many"])).shards) >= 8
    return manifests


def _cfg(sources: list[tuple[Path, float]], **overrides) -> DataConfig:
    fields = dict(seq_len=32, micro_batch_size=2, seed=5)
    fields.update(overrides)
    return DataConfig(sources=[DataSource(manifest=str(m), weight=w) for m, w in sources], **fields)


def _lengths(manifest: Path, skip: set[str] = frozenset()) -> dict[tuple[str, int, int], int]:
    """(manifest, shard, sample) -> tokens + EOS of every readable document."""
    parsed = read_manifest(str(manifest))
    out = {}
    for i, entry in enumerate(parsed.shards):
        if entry.name in skip:
            continue
        docs = read_shard(resolve(str(manifest), entry.name), entry, allow_pipe=False)
        for j, doc in enumerate(docs):
            out[(str(manifest), i, j)] = len(doc.tokens) + 1
    return out


class Run:
    """A run of segments at changing layouts; collects what was trained (after the cuts)."""

    def __init__(self, trace_dir: Path) -> None:
        self.trace_dir = trace_dir
        self.states: dict | None = None
        self.messages: list[str] = []
        self.batch_counts: list[int] = []

    def segment(self, cfg: DataConfig, dp_size: int, take: int | None, lost: int = 3) -> None:
        """Every rank takes `take` batches (None: to the end), saves, takes `lost` more."""
        loaders = []
        for rank in range(dp_size):
            loader = StreamingLoader(
                cfg, rank, dp_size, trace=str(self.trace_dir / f"dp{rank}.jsonl")
            )
            if self.states is not None:
                message = loader.resume(self.states)
                if rank == 0:
                    self.messages.append(message)
            loaders.append(loader)
        iterators = [iter(loader) for loader in loaders]
        if take is None:
            self.batch_counts = [len(list(it)) for it in iterators]
            return
        for it in iterators:
            for _ in range(take):
                next(it)
        states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
        self.lost = [[next(it) for _ in range(lost)] for it in iterators]
        for it in iterators:
            it.close()
        # as checkpoint/save.py saves them: the segment once, a record per rank
        self.states = json.loads(json.dumps(saved_file(states[0], states)))

    def trained(self) -> Counter:
        """(manifest, epoch, shard, sample) -> tokens trained, from the trace."""
        return trace.trained(self.trace_dir)


def _epoch(counts: Counter, epoch: int) -> dict[tuple[str, int, int], int]:
    return {(m, s, j): n for (m, e, s, j), n in counts.items() if e == epoch}


@pytest.mark.parametrize("mode", ["finite", "streaming", "finite-skip"])
def test_an_epoch_interrupted_twice_at_other_layouts_trains_every_document_once(
    corpora, tmp_path, mode
):
    many, few = corpora["many"], corpora["few"]
    skip: set[str] = set()
    if mode == "finite-skip":  # one shard unreadable: skipped, and still skipped after resumes
        shutil.copytree(many.parent, tmp_path / "many")
        many = tmp_path / "many" / "manifest.json"
        victim = read_manifest(str(many)).shards[4].name
        (many.parent / victim).write_bytes(b"garbage" * 100)
        skip = {victim}
    epochs = None if mode == "streaming" else 1
    extra = {"on_error": "skip"} if skip else {}
    sources = [(many, 0.7), (few, 0.3)]
    run = Run(tmp_path)
    # dp 2 x 1 worker -> dp 3 x 2 workers (6 slots: 'few' strides) -> dp 1 x 1 worker
    run.segment(_cfg(sources, epochs=epochs, **extra), 2, take=9)
    run.segment(_cfg(sources, epochs=epochs, num_workers=2, **extra), 3, take=6)
    # the same layout resumed from the same states goes on exactly as the lost batches went
    again = StreamingLoader(_cfg(sources, epochs=epochs, num_workers=2, **extra), 1, 3)
    assert again.resume(run.states) == ""
    for lost, batch in zip(run.lost[1], again, strict=False):
        assert all(torch.equal(lost[k], batch[k]) for k in ("tokens", "labels", "loss_mask"))
    if epochs:
        run.segment(_cfg(sources, epochs=epochs, **extra), 1, take=None)
    else:  # on well into the next epoch, in larger batches
        run.segment(_cfg(sources, micro_batch_size=8, **extra), 1, take=400)
        assert "micro_batch_size 2 -> 8" in run.messages[1]

    check_resumable(run.states, 1, 0, 2)  # a dry run lets any layout resume a version 2 state
    assert "data-parallel size 2 -> 3" in run.messages[0]
    assert "loader workers 1 -> 2" in run.messages[0]
    assert "data-parallel size 3 -> 1" in run.messages[1]
    assert "loader workers 2 -> 1" in run.messages[1]
    assert all("\n" not in m for m in run.messages)
    expected = {**_lengths(many, skip), **_lengths(few)}
    counts = run.trained()
    first = _epoch(counts, 0)
    assert first == expected  # every readable document, every token once, none twice
    later = _epoch(counts, 1)
    assert all(n <= expected[doc] for doc, n in later.items())
    if epochs is None:
        assert later  # the stream went on into the next epoch
    else:
        assert not later


def test_finite_epochs_resumed_at_another_layout_give_every_rank_the_same_batch_count(
    corpora, tmp_path
):
    run = Run(tmp_path)
    sources = [(corpora["many"], 1.0), (corpora["few"], 1.0)]
    run.segment(_cfg(sources, epochs=1), 3, take=5)
    run.segment(_cfg(sources, epochs=1), 2, take=None)
    assert len(set(run.batch_counts)) == 1


def test_mix_change_on_resume_keeps_added_and_removed_sources_apart(corpora, tmp_path):
    many, few, other = corpora["many"], corpora["few"], corpora["other"]
    run = Run(tmp_path)
    run.segment(_cfg([(many, 0.5), (few, 0.5)], epochs=1), 2, take=8)
    # 'few' removed, 'other' added: 'many' goes on, 'other' starts at its beginning
    run.segment(_cfg([(other, 0.5), (many, 0.5)], epochs=1), 2, take=6)
    # 'many' reweighted
    run.segment(_cfg([(other, 0.5), (many, 0.2)], epochs=1), 2, take=None)
    assert f"source {few} removed" in run.messages[0]
    assert f"source {other} added: starts at its beginning" in run.messages[0]
    assert f"source {many} weight 0.5 -> 0.2" in run.messages[1]
    counts = _epoch(run.trained(), 0)
    for manifest in (many, other):  # kept and added sources: every document once
        mine = {k: n for k, n in counts.items() if k[0] == str(manifest)}
        assert mine == _lengths(manifest)
    few_lengths = _lengths(few)
    removed = {k: n for k, n in counts.items() if k[0] == str(few)}
    assert removed and all(n <= few_lengths[k] for k, n in removed.items())
    assert len(removed) < len(few_lengths)  # the rest of it was dropped, as the line said


def _v1(state: dict) -> dict:
    """A state as del-megatron wrote it before the cursor resharded."""
    old = {k: state[k] for k in ("dp_rank", "dp_size", "num_workers", "consumed")}
    workers = {}
    for worker, ws in state["workers"].items():
        ws = {k: v for k, v in ws.items() if k != "pending_docs"}
        workers[worker] = {**ws, "version": 1}
    return {**old, "version": 1, "workers": workers}


def test_version_1_state_loads_at_its_layout_and_is_refused_at_another(corpora):
    cfg = _cfg([(corpora["many"], 1.0), (corpora["few"], 1.0)])
    straight = StreamingLoader(cfg, 1, 2)
    it = iter(straight)
    for _ in range(5):
        next(it)
    states = [_v1(StreamingLoader(cfg, 0, 2).state_dict()), _v1(straight.state_dict())]
    expected = [next(it) for _ in range(4)]
    resumed = StreamingLoader(cfg, 1, 2)
    assert resumed.resume(json.loads(json.dumps(states))) == ""
    for a, b in zip(expected, resumed, strict=False):
        assert torch.equal(a["tokens"], b["tokens"])
    with pytest.raises(DataError) as err:
        StreamingLoader(cfg, 0, 1).resume(states)
    with pytest.raises(DataError) as dry_run:  # preflight refuses it the same way
        check_resumable(states, 1, 0, 2)
    assert str(dry_run.value) == str(err.value)
    assert "\n" not in str(err.value)
    assert "was saved at data-parallel size 2, this run has 1: resume at data-parallel size 2" in (
        str(err.value)
    )


def test_slots_in_different_epochs_at_a_change_train_both_epochs_once(corpora, tmp_path):
    few = corpora["few"]
    run = Run(tmp_path)
    cfg = _cfg([(few, 1.0)], epochs=2)
    run.segment(cfg, 2, take=140)  # the slot with the smaller shard is into epoch 1 already
    epochs = {s["workers"]["0"]["readers"][0]["epoch"] for s in run.states["ranks"]}
    assert epochs == {0, 1}
    run.segment(_cfg([(few, 1.0)], epochs=2, num_workers=2), 3, take=20)
    run.segment(cfg, 1, take=None)
    counts = run.trained()
    assert _epoch(counts, 0) == _epoch(counts, 1) == _lengths(few)


def test_a_skipped_shard_of_a_striding_source_stays_skipped(corpora, tmp_path):
    shutil.copytree(corpora["few"].parent, tmp_path / "few")
    few = tmp_path / "few" / "manifest.json"
    manifest = read_manifest(str(few))
    first = cursor.shard_order(manifest, cursor.Order(seed=5, shuffle=True, index=0), 0)[0]
    victim = manifest.shards[first].name  # read first: every slot has passed it at the change
    (few.parent / victim).write_bytes(b"garbage" * 100)
    run = Run(tmp_path)
    cfg = _cfg([(few, 1.0)], epochs=1, on_error="skip")  # 2 shards, 3 or 4 slots: striding
    run.segment(cfg, 3, take=10)
    run.segment(_cfg([(few, 1.0)], epochs=1, on_error="skip", num_workers=2), 2, take=5)
    run.segment(cfg, 3, take=None)
    assert _epoch(run.trained(), 0) == _lengths(few, {victim})


def test_as_many_slots_at_another_layout_read_what_an_unchanged_run_reads(corpora, tmp_path):
    """dp 2 x 1 worker -> dp 1 x 2 workers: the same two slots, so each keeps its stream and the
    run reads its batches in the order an unchanged run would (the trainer's held-out loss
    then matches an uninterrupted run's: tests/training/test_resume_layouts.py)."""
    sources = [(corpora["many"], 0.7), (corpora["few"], 0.3)]
    straight = [StreamingLoader(_cfg(sources), rank, 2) for rank in range(2)]
    iterators = [iter(loader) for loader in straight]
    per_rank = [[next(it) for _ in range(8)] for it in iterators]
    unchanged = [per_rank[rank][step] for step in range(4, 8) for rank in range(2)]

    run = Run(tmp_path)
    run.segment(_cfg(sources), 2, take=4)
    resumed = StreamingLoader(_cfg(sources, num_workers=2), 0, 1)
    message = resumed.resume(run.states)
    assert "data-parallel size 2 -> 1" in message and "every loader slot continues" in message
    for expected, batch in zip(unchanged, resumed, strict=False):
        assert all(torch.equal(expected[k], batch[k]) for k in ("tokens", "labels", "loss_mask"))


def test_finite_epochs_at_the_same_slot_count_give_every_rank_the_same_batch_count(
    corpora, tmp_path
):
    """dp 2 x 2 workers -> dp 4 x 1 worker: slots have made unequal batch counts (3 a rank over
    2 workers), so keeping each slot's stream would leave ranks with different counts left and
    one rank would stop while the others wait in a collective; finite epochs reshard."""
    run = Run(tmp_path)
    sources = [(corpora["many"], 1.0), (corpora["few"], 1.0)]
    run.segment(_cfg(sources, epochs=1, num_workers=2), 2, take=3)
    run.segment(_cfg(sources, epochs=1), 4, take=None)
    assert len(set(run.batch_counts)) == 1, run.batch_counts
    expected = {**_lengths(corpora["many"]), **_lengths(corpora["few"])}
    assert _epoch(run.trained(), 0) == expected


def test_a_taken_epoch_ahead_of_every_slot_survives_the_next_reshard(corpora):
    """A segment can start with documents of a later epoch taken (a fast slot had reached it);
    if the next save finds every slot still in the earlier epoch, that later epoch's taken set
    must be carried on, or the reshard after it reads those documents again."""
    from del_megatron.data import cursor
    from del_megatron.data.format import read_manifest
    from del_megatron.data.reshard import taken_after

    manifest = read_manifest(str(corpora["many"]))
    ahead = np.zeros(manifest.documents, bool)
    ahead[:3] = True
    before = {0: np.zeros(manifest.documents, bool), 1: ahead}
    before[0][:5] = True
    start = {"epoch": 0, "shard_pos": 0, "sample_pos": 0, "seen": 0, "taken": 0}
    order = cursor.Order(5, True, 0)
    first, taken = taken_after(manifest, order, before, [start, dict(start)], [set(), set()], 2)
    assert first == 0
    assert np.array_equal(taken[1], ahead)


def test_a_malformed_data_state_is_one_line_at_the_dry_run_and_the_resume(corpora):
    """What a user's tampered or truncated data_state.json gives: one DataError line naming the
    file, from the dry run's check and the resume alike (not a KeyError or a zlib error)."""
    cfg = _cfg([(corpora["many"], 1.0), (corpora["few"], 1.0)])
    saved = [StreamingLoader(cfg, rank, 2).state_dict() for rank in range(2)]
    no_segment = [dict(saved[0]), saved[1]]
    del no_segment[0]["segment"]
    bad_taken = json.loads(json.dumps(saved))
    bad_taken[0]["segment"]["taken"] = [{"0": "not base64!"}, {}]
    cases = {
        "not a list": ({"dp_rank": 0}, "not a list of per-rank"),
        "a field missing": (no_segment, "entry 0 is not a data-loader state"),
        "a rank missing": ([saved[1]], "no data-loader state of data-parallel rank 0"),
        "a corrupt taken set": (bad_taken, "a taken-document set is corrupt"),
    }
    for name, (states, expected) in cases.items():
        with pytest.raises(DataError) as err:
            StreamingLoader(cfg, 0, 1).resume(states)
        assert expected in str(err.value) and "\n" not in str(err.value), name
        if name != "a corrupt taken set":  # decoded at the resume only
            with pytest.raises(DataError, match=expected):
                check_resumable(states, 1, 0, 2)
