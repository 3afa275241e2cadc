"""The pure parts of the data cursor: plans with and without taken documents, the compact
taken sets, and the trace reader's rules for what a kill lost."""

from __future__ import annotations

import json

import numpy as np

from del_megatron.data import Manifest, ShardEntry, TokenizerInfo, cursor, trace


def _manifest(samples: list[int]) -> Manifest:
    shards = tuple(
        ShardEntry(name=f"s{i}.tar", samples=n, tokens=10 * n, bytes=0, sha256="")
        for i, n in enumerate(samples)
    )
    tok = TokenizerInfo(fingerprint="vocab-x", vocab_size=10, eos_id=2, source="t")
    return Manifest(tokenizer=tok, shards=shards, documents=sum(samples), tokens=0)


def test_nothing_taken_is_the_plan_of_a_run_that_never_changed_layout():
    manifest = _manifest([5, 0, 7, 3, 9, 4])
    order = cursor.Order(seed=3, shuffle=True, index=1)
    shards = cursor.rng(3, 1, 2).permutation(6)  # the epoch's order as it always was
    for slots in (1, 2, 4, 6, 7):
        for slot in range(slots):
            plan = cursor.slot_plan(manifest, order, 2, None, slot, slots)
            assert plan.striding == (slots > 6)
            assert plan.shards == [int(s) for s in (shards if slots > 6 else shards[slot::slots])]
    samples = cursor.rng(3, 1, 2, 4).permutation(9)
    assert cursor.left_in_shard(manifest, order, 2, 4, None).tolist() == samples.tolist()


def test_prefixes_of_all_slots_cover_the_epoch_once_and_taken_shards_leave_the_plan():
    manifest = _manifest([5, 6, 7, 3, 9, 4])
    order = cursor.Order(seed=1, shuffle=True, index=0)
    for slots in (2, 8):  # whole shards; per-document striding
        parts = [
            cursor.read_prefix(manifest, order, 0, None, s, slots, None, set())
            for s in range(slots)
        ]
        every = np.concatenate(parts)
        assert sorted(every.tolist()) == list(range(manifest.documents))
    taken = np.zeros(manifest.documents, bool)
    first = cursor.offsets(manifest)
    taken[first[2] : first[3]] = True  # shard 2 read entirely
    taken[first[4] + 1] = True  # one document of shard 4
    plans = [cursor.slot_plan(manifest, order, 0, taken, s, 5) for s in range(5)]
    assert sorted(s for p in plans for s in p.shards) == [0, 1, 3, 4, 5]
    assert 1 not in (first[4] + cursor.left_in_shard(manifest, order, 0, 4, taken)).tolist()


def test_taken_sets_are_compact():
    documents = 1_000_000
    taken = np.zeros(documents, bool)
    taken[: documents // 3] = True  # whole shards: runs
    taken[np.random.default_rng(0).integers(0, documents, 5000)] = True  # partly read shards
    text = cursor.encode(taken)
    assert np.array_equal(cursor.decode(text, documents), taken)
    assert len(text) < 20_000  # 125 KB of bits


def _write(path, *lines):
    with open(path, "a") as f:
        for line in lines:
            f.write(line)


def test_trace_drops_what_a_kill_lost(tmp_path):
    doc = lambda n: [["m", 0, 0, n, 1]]  # noqa: E731 - one token of document n
    path = tmp_path / "dp00000.jsonl"
    # segment "0": 6 batches, killed; resumed from a checkpoint after batch 2, ran to 4,
    # killed; resumed again at another layout from a checkpoint after batch 3
    _write(path, trace.start_line("0", 0, 0, None, 1))
    _write(path, *(trace.batch_line("0", 0, c, doc(c)) for c in range(1, 7)))
    _write(path, trace.start_line("0", 0, 2, None, 2))
    _write(path, *(trace.batch_line("0", 0, c, doc(10 + c)) for c in range(3, 5)))
    follows = {"segment": "0", "consumed": {"0": 3}}
    _write(path, trace.start_line("b", 0, 0, follows, 4))
    _write(path, trace.batch_line("b", 0, 1, doc(99)))
    # an attempt at a third layout from the same checkpoint, older than "b", never continued
    _write(tmp_path / "dp00001.jsonl", trace.start_line("c", 1, 0, follows, 3))
    _write(tmp_path / "dp00001.jsonl", trace.batch_line("c", 1, 1, doc(77)))
    counts = trace.trained(tmp_path)
    assert sorted(key[3] for key in counts) == [1, 2, 13, 99]
    assert json.loads(path.read_text().splitlines()[0])["follows"] is None
