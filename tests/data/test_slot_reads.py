"""The rule of which documents a slot reads (cursor.slot_reads) has three users: the reader
(next_document), the batch count of finite epochs (planned_tokens) and a reshard's prefix of
an old slot (read_prefix). They must agree at every position, with and without documents
taken before, in whole-shard and striding plans, or a reshard skips or repeats documents."""

from __future__ import annotations

import numpy as np
import pytest

from del_megatron.data import DataConfig, DataSource, cursor, read_manifest
from del_megatron.data.stream import SourceReader


@pytest.mark.parametrize("slots", [3, 40])  # whole shards (~20 of them); striding
@pytest.mark.parametrize("taken_before", [False, True])
def test_reader_prefix_and_planned_tokens_agree_at_every_position(
    synth_shards, slots, taken_before
):
    url = str(synth_shards)
    manifest = read_manifest(url)
    cfg = DataConfig(
        sources=[DataSource(manifest=url)], seq_len=16, micro_batch_size=1, seed=7, epochs=1
    )
    taken = None
    if taken_before:  # a segment after a change: some shards whole, some documents taken
        taken = np.random.default_rng(0).random(manifest.documents) < 0.2
        first = cursor.offsets(manifest)
        taken[first[3] : first[5]] = True
    order = cursor.Order(cfg.seed, cfg.shuffle, 0)
    offsets = cursor.offsets(manifest)
    every: list[int] = []
    for slot in (0, slots - 1):
        reader = SourceReader(
            url, manifest, 0, slot, slots, cfg, [], {0: taken} if taken_before else None
        )
        planned = reader.planned_tokens(1)
        read, tokens = [], 0
        while (found := reader.next_document()) is not None:
            read.append(int(offsets[found.shard] + found.sample))
            tokens += len(found.document.tokens) + 1
            if found.epoch == 0 and len(read) % 7 == 1:  # the prefix at this position
                position = reader.state_dict()
                prefix = cursor.read_prefix(manifest, order, 0, taken, slot, slots, position, set())
                assert prefix.tolist() == read, (slot, len(read))
        whole = cursor.read_prefix(manifest, order, 0, taken, slot, slots, None, set())
        assert whole.tolist() == read
        assert planned == tokens
        every += read
    if slots == 3:  # no document read twice by two slots
        assert len(set(every)) == len(every)
    if taken is not None:
        assert not taken[every].any()  # nothing taken before is read again
