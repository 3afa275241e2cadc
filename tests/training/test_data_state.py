"""A checkpoint's data state (checkpoint/save.py, checkpoint/directory.py, data/state.py):
written as one record
(the segment with its taken sets once, one record per data-parallel rank) gathered to the rank
that writes it without bytes growing with the tensor-parallel size; read through one function
(directory.data_state) whether written so or in the list form of before (one state per
global rank, tensor-parallel copies included), at the saved layout and at another.

The save is run for every rank of a layout in one process: the gather is replaced by one that
records what each rank sends, so the test sees the bytes each rank hands over."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from del_megatron.checkpoint import directory
from del_megatron.checkpoint import save as saving
from del_megatron.checkpoint.layout import Place
from del_megatron.data import DataConfig, DataSource, StreamingLoader

from .test_bad_input import fake_checkpoint, setup, with_optimizer_files  # noqa: F401

DP = 3  # the saved data-parallel size: the list form's entries differ from the record's ranks


def assert_data_state_record(checkpoint_dir: Path, *, dp_size: int) -> None:
    """A checkpoint a real run wrote holds the data state as one record: the segment with its
    taken sets once, then one record per data-parallel rank, in rank order."""
    record = json.loads((checkpoint_dir / "data_state.json").read_text())
    assert record["version"] == 3 and record["dp_size"] == dp_size
    assert [rank["dp_rank"] for rank in record["ranks"]] == list(range(dp_size))
    assert record["segment"]["taken"] is not None
    saved = directory.data_state(checkpoint_dir)
    assert saved is not None and all(rank.workers for rank in saved.ranks)


def resharded_loaders(manifest: Path) -> list[StreamingLoader]:
    """DP loaders a few batches into a segment that follows a change of layout (2 -> DP):
    the segment has taken sets, and every worker a position."""
    cfg = DataConfig(
        sources=[DataSource(manifest=str(manifest))], seq_len=16, micro_batch_size=1, epochs=1
    )
    first = [StreamingLoader(cfg, rank, 2) for rank in range(2)]
    for loader in first:
        batches = iter(loader)
        for _ in range(5):
            next(batches)
    states = [json.loads(json.dumps(loader.state_dict())) for loader in first]
    loaders = [StreamingLoader(cfg, rank, DP) for rank in range(DP)]
    for loader in loaders:
        loader.resume(states)
        batches = iter(loader)
        for _ in range(3):
            next(batches)
    return loaders


def save_every_rank(directory: Path, loaders, tp: int, monkeypatch) -> dict[int, int]:
    """saving._data_state_job (and its write) on every global rank of TP x DP (rank =
    tp_rank + TP x dp_rank, megatron's order), the writer (rank 0) last; returns the bytes
    each rank sent."""
    from megatron.core import parallel_state

    sent: dict[int, int] = {}
    received: dict[int, object] = {}

    def gather(obj, *, group=None):
        sent[rank] = len(pickle.dumps(obj))
        received[dp_rank] = obj
        return [received[r] for r in range(DP)] if rank == 0 else None

    for rank in reversed(range(tp * DP)):
        tp_rank, dp_rank = rank % tp, rank // tp
        monkeypatch.setattr(
            parallel_state, "get_tensor_model_parallel_rank", lambda tp_rank=tp_rank: tp_rank
        )
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(saving.collectives, "gather_object", gather)
        place = Place(rank=rank, world=tp * DP, tp_rank=tp_rank, dp_rank=dp_rank)
        job = saving._data_state_job(SimpleNamespace(place=place), directory, loaders[dp_rank])
        if job is not None:
            job()
    return sent


def test_the_save_sends_each_data_parallel_rank_s_own_record_once(
    tmp_path, synth_shards, monkeypatch
):
    """Fails on the code before: every global rank all-gathered its whole state (the mix, the
    settings, the segment; data-parallel rank 0's with the taken sets) to every rank, and the
    file held one state per global rank: bytes grew with the tensor-parallel size."""
    loaders = resharded_loaders(synth_shards)
    written, sent = {}, {}
    for tp in (1, 2, 4):
        directory = tmp_path / f"tp{tp}"
        directory.mkdir()
        sent[tp] = save_every_rank(directory, loaders, tp, monkeypatch)
        written[tp] = (directory / "data_state.json").read_text()
        assert sorted(sent[tp]) == [tp * r for r in range(DP)]  # tensor-parallel rank 0s only
    assert written[1] == written[2] == written[4]
    for tp in (2, 4):
        assert [sent[tp][tp * r] for r in range(DP)] == [sent[1][r] for r in range(DP)]
    record = json.loads(written[1])
    assert record["version"] == 3 and [r["dp_rank"] for r in record["ranks"]] == [0, 1, 2]
    assert record["segment"]["taken"] and any(record["segment"]["taken"])  # once, in the file
    assert set(record["ranks"][0]) == {"dp_rank", "consumed", "workers"}
    for rank, size in sent[1].items():  # its own record: no segment, mix or settings
        assert size == len(pickle.dumps(record["ranks"][rank]))


def test_a_checkpoint_of_the_list_form_reads_as_one_of_the_record(
    tmp_path, synth_shards, monkeypatch
):
    """The list form written before (checkpoint.py then: json.dumps of every global rank's
    state_dict(), tensor-parallel peers alike, at TP 2) and the record read through
    directory.data_state into the same typed state, which the loader resumes at the saved
    layout and at others (tests/data/test_state.py: the same batches from the same state)."""
    loaders = resharded_loaders(synth_shards)
    new, old = tmp_path / "record", tmp_path / "list"
    new.mkdir()
    old.mkdir()
    save_every_rank(new, loaders, 2, monkeypatch)
    states = [loader.state_dict() for loader in loaders]
    (old / "data_state.json").write_text(json.dumps([s for s in states for _ in range(2)]))
    saved = directory.data_state(new)
    assert saved is not None and len(saved.ranks) == DP
    assert directory.data_state(old) == saved
    for dp_size in (DP, 1):
        for rank in range(dp_size):
            a = StreamingLoader(loaders[0].cfg, rank, dp_size)
            b = StreamingLoader(loaders[0].cfg, rank, dp_size)
            assert a.resume(directory.data_state(old)) == b.resume(saved)
            assert a.state_dict() == b.state_dict()


@pytest.mark.parametrize("form", ["record", "list"])
@pytest.mark.parametrize("layout", ["saved", "another"])
def test_the_dry_run_resumes_either_form_at_the_saved_layout_and_another(
    form, layout, request, monkeypatch, capsys
):
    """A checkpoint (saved at TP 2 x DP 1) whose data_state.json is in either form passes the
    start-up checks at its layout and at TP 1 x DP 2; a record whose data-parallel size is not
    meta.json's is refused in one line."""
    from del_megatron.cli.train import main

    _, config, _, fingerprint, tree = request.getfixturevalue("setup")
    path = fake_checkpoint(Path(tree["output_dir"]), tree, fingerprint)
    with_optimizer_files(path)
    from del_megatron.config import parse_run_config

    loader = StreamingLoader(parse_run_config(tree).data_config(), 0, 1)
    next(iter(loader))
    state = json.loads(json.dumps(loader.state_dict()))
    if form == "list":
        (path / "data_state.json").write_text(json.dumps([state, state]))
    else:
        monkeypatch.setattr(saving.collectives, "gather_object", lambda obj, group: [obj])
        from megatron.core import parallel_state

        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)
        place = Place(rank=0, world=1)
        saving._data_state_job(SimpleNamespace(place=place), path, loader)()
    extra = [] if layout == "saved" else ["parallel.tensor_parallel=1"]
    code = main(["--config", str(config), "--dry-run", *extra, "--resume", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert '"resume_step": 4' in out, out
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "data_parallel": 2}))
    code = main(["--config", str(config), "--dry-run", *extra, "--resume", str(path)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert "saved at data-parallel size 1, meta.json says 2" in err, err
