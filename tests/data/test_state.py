"""A saved data state is read once, into typed records (data/state.py): a state of ours with a
field of the wrong shape is the same one line at the dry run and at the resume, never a
KeyError or TypeError from deep in the resume."""

from __future__ import annotations

import json

import pytest
import torch

from del_megatron.data import DataConfig, DataError, DataSource, StreamingLoader
from del_megatron.data.state import check_resumable, read_saved


def _states(synth_shards) -> tuple[DataConfig, list[dict]]:
    cfg = DataConfig(
        sources=[DataSource(manifest=str(synth_shards))], seq_len=16, micro_batch_size=1
    )
    loaders = [StreamingLoader(cfg, rank, 2) for rank in range(2)]
    for loader in loaders:
        next(iter(loader))
    return cfg, [json.loads(json.dumps(loader.state_dict())) for loader in loaders]


def test_tensor_parallel_copies_become_one_record_per_data_parallel_rank(synth_shards):
    _, states = _states(synth_shards)
    saved = read_saved([s for s in states for _ in range(2)])  # as data_state.json holds them
    assert saved is not None
    assert [rank.dp_rank for rank in saved.ranks] == [0, 1]
    assert saved.segment.taken is not None  # the taken sets, once
    assert [state is not None for state in saved.slot_states()] == [True, True]


@pytest.mark.parametrize(
    "damage",
    ["segment without batch_limit", "segment null", "worker key not a number", "workers a list"],
)
def test_a_malformed_field_inside_a_state_is_one_line_at_the_dry_run_and_the_resume(
    synth_shards, damage
):
    cfg, states = _states(synth_shards)
    state = states[1]
    if damage == "segment without batch_limit":
        del state["segment"]["batch_limit"]
    elif damage == "segment null":
        state["segment"] = None
    elif damage == "worker key not a number":
        state["workers"] = {"w0": state["workers"]["0"]}
    else:
        state["workers"] = [state["workers"]["0"]]
    expected = "data_state.json: entry 1 is not a data-loader state this del-megatron reads"
    with pytest.raises(DataError, match=expected):
        check_resumable(states, 1, 0, 1)
    with pytest.raises(DataError, match=expected) as err:
        StreamingLoader(cfg, 0, 1).resume(states)
    assert "\n" not in str(err.value)


def test_the_one_record_file_resumes_as_the_list_of_per_rank_states_does(synth_shards):
    """saved_file (the segment and its taken sets once, a record per data-parallel rank) and
    the list data_state.json held before (one state per global rank) resume alike: the same
    line, the same batches, at the same layout and another."""
    from del_megatron.data.state import saved_file

    cfg, _ = _states(synth_shards)
    first = [StreamingLoader(cfg.model_copy(update={"epochs": 1}), rank, 2) for rank in range(2)]
    for loader in first:  # a few batches, then a reshard 2 -> 3 with taken sets
        batches = iter(loader)
        for _ in range(5):
            next(batches)
    middle = [StreamingLoader(cfg.model_copy(update={"epochs": 1}), rank, 3) for rank in range(3)]
    for loader in middle:
        loader.resume([json.loads(json.dumps(s.state_dict())) for s in first for _ in range(2)])
        batches = iter(loader)
        for _ in range(3):
            next(batches)
    listed = [json.loads(json.dumps(loader.state_dict())) for loader in middle for _ in range(2)]
    record = json.loads(json.dumps(saved_file(listed[0], listed[::2])))
    assert len(json.dumps(record)) < len(json.dumps(listed)) / 2  # no copies
    check_resumable(record, 1, 0, 1)
    for dp_size in (3, 1):
        for rank in range(dp_size):
            a = StreamingLoader(cfg.model_copy(update={"epochs": 1}), rank, dp_size)
            b = StreamingLoader(cfg.model_copy(update={"epochs": 1}), rank, dp_size)
            assert a.resume(listed) == b.resume(record)
            assert a.state_dict() == b.state_dict()
            for x, y in zip(a, b, strict=True):
                assert all(torch.equal(x[k], y[k]) for k in ("tokens", "labels", "loss_mask"))


def test_a_data_state_of_another_file_version_is_one_line_naming_the_fix(synth_shards):
    """A data_state.json of a later file version (a checkpoint of a newer del-megatron) is
    refused in one line naming what to do, not read as a list of states."""
    from del_megatron.data.state import FILE_VERSION, NO_LOADER, saved_file

    cfg, states = _states(synth_shards)
    record = saved_file(states[0], states)
    assert read_saved(json.loads(json.dumps(saved_file(None, [])))) is None
    assert saved_file(None, []) == NO_LOADER
    for version in (FILE_VERSION + 1, 1):
        with pytest.raises(DataError, match=f"version {version}, this del-megatron reads 3") as err:
            StreamingLoader(cfg, 0, 1).resume({**record, "version": version})
        assert "resume with the del-megatron that wrote it" in str(err.value)
