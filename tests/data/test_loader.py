"""The streaming loader: packing, assignment, mixing, exact resume, equal steps, bad data."""

from __future__ import annotations

import functools
import http.server
import io
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from data_tools.build import build_shards
from del_megatron.data import DataConfig, DataError, DataSource, StreamingLoader, read_manifest
from del_megatron.data.format import read_shard, resolve
from del_megatron.tokenizer import Tokenizer

from .streams import documents_of, stream_of


def _cfg(*manifests, weights=None, **overrides) -> DataConfig:
    weights = weights or [1.0] * len(manifests)
    fields = dict(seq_len=64, micro_batch_size=2, seed=3)
    fields.update(overrides)
    return DataConfig(
        sources=[
            DataSource(manifest=str(m), weight=w) for m, w in zip(manifests, weights, strict=True)
        ],
        **fields,
    )


def _all_documents(manifest_path: Path) -> list[tuple[int, ...]]:
    manifest = read_manifest(str(manifest_path))
    return [
        tuple(d.tokens.tolist())
        for e in manifest.shards
        for d in read_shard(resolve(str(manifest_path), e.name), e, allow_pipe=False)
    ]


def _take(loader, n):
    return [b for _, b in zip(range(n), loader, strict=False)]


def test_windows_labels_and_masks(synth_shards, synth_tokenizer):
    eos = Tokenizer(synth_tokenizer).eos_id
    batch = next(
        iter(StreamingLoader(_cfg(synth_shards, mask_after_boundary=True, micro_batch_size=16)))
    )
    assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (16, 64)
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])  # labels shifted
    # consecutive windows share one token, as Megatron's GPT dataset
    assert batch["labels"][0, -1] == batch["tokens"][1, 0]
    # mask_after_boundary: the target right after each EOS is not trained
    after_eos = batch["tokens"] == eos
    assert after_eos.any() and (batch["loss_mask"][after_eos] == 0).all()


@pytest.mark.parametrize("workers", [0, 2])
def test_one_epoch_reads_each_document_once_per_data_parallel_group(synth_shards, workers):
    expected = sorted(_all_documents(synth_shards))
    eos = read_manifest(str(synth_shards)).tokenizer.eos_id
    seen, counts = [], []
    for dp_rank in range(2):
        loader = StreamingLoader(_cfg(synth_shards, epochs=1, num_workers=workers), dp_rank, 2)
        batches = list(loader)
        counts.append(len(batches))
        per_worker = [batches[w :: max(workers, 1)] for w in range(max(workers, 1))]
        for part in per_worker:
            seen += documents_of(*stream_of(part), eos)
    assert sorted(seen) == expected
    assert counts[0] == counts[1]  # equal steps on every rank


def test_fewer_shards_than_slots_strides_samples(tmp_path, synth_corpus, synth_tokenizer):
    build_shards(
        [synth_corpus / "train.jsonl"],
        tmp_path,
        synth_tokenizer,
        shard_bytes=1 << 30,
        progress=False,
    )  # one shard for 4 slots
    manifest = tmp_path / "manifest.json"
    assert len(read_manifest(str(manifest)).shards) == 1
    eos = read_manifest(str(manifest)).tokenizer.eos_id
    seen, counts = [], []
    for dp_rank in range(4):
        batches = list(StreamingLoader(_cfg(manifest, epochs=1), dp_rank, 4))
        counts.append(len(batches))
        seen += documents_of(*stream_of(batches), eos)
    assert sorted(seen) == sorted(_all_documents(manifest))
    assert len(set(counts)) == 1


def test_tensor_parallel_peers_get_identical_batches(synth_shards):
    a = _take(StreamingLoader(_cfg(synth_shards, num_workers=2), 1, 2), 9)
    b = _take(StreamingLoader(_cfg(synth_shards, num_workers=2), 1, 2), 9)
    other = _take(StreamingLoader(_cfg(synth_shards, num_workers=2), 0, 2), 9)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0]["tokens"], other[0]["tokens"])


def test_shuffle_depends_on_seed_and_epoch(synth_shards):
    first = _take(StreamingLoader(_cfg(synth_shards, seed=1)), 3)
    again = _take(StreamingLoader(_cfg(synth_shards, seed=1)), 3)
    other = _take(StreamingLoader(_cfg(synth_shards, seed=2)), 3)
    assert torch.equal(first[0]["tokens"], again[0]["tokens"])
    assert not torch.equal(first[0]["tokens"], other[0]["tokens"])


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, synth_tokenizer):
    """'alpha' documents and 'beta' documents, as two shard sets of one tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    manifests = {}
    for name, count in (("alpha", 400), ("beta", 300)):
        lines = [
            json.dumps(
                {
                    "text": f"{name} "
                    + " ".join(str(x) for x in rng.integers(0, 10**6, rng.integers(5, 60)))
                    + " end"
                }
            )
            for _ in range(count)
        ]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        build_shards(
            [root / f"{name}.jsonl"],
            root / name,
            synth_tokenizer,
            shard_bytes=16 << 10,
            progress=False,
        )
        manifests[name] = root / name / "manifest.json"
    return manifests


def test_mixing_by_tokens_within_one_percent_over_a_million_tokens(two_sources, synth_tokenizer):
    tok = Tokenizer(synth_tokenizer)
    alpha_start = tok.encode("alpha")[0]
    cfg = _cfg(
        two_sources["alpha"],
        two_sources["beta"],
        weights=[0.7, 0.3],
        seq_len=1024,
        micro_batch_size=8,
    )
    tokens, mask = stream_of(_take(StreamingLoader(cfg), 123))  # > 1M tokens
    assert len(tokens) > 1_000_000
    docs = documents_of(tokens, mask, tok.eos_id)[1:]  # the first may be cut by nothing: keep
    alpha = sum(len(d) + 1 for d in docs if d and d[0] == alpha_start)
    total = sum(len(d) + 1 for d in docs)
    assert abs(alpha / total - 0.7) < 0.01


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("split", [1, 7, 23])
def test_resume_continues_with_the_next_unseen_window(two_sources, workers, split):
    cfg = _cfg(
        two_sources["alpha"],
        two_sources["beta"],
        weights=[0.7, 0.3],
        num_workers=workers,
        seq_len=48,
        micro_batch_size=3,
    )
    total = 40
    straight = _take(StreamingLoader(cfg, 1, 2), total)
    first = StreamingLoader(cfg, 1, 2)
    head = _take(first, split)
    state = first.state_dict()
    buffer = io.BytesIO()
    torch.save(json.loads(json.dumps(state)), buffer)  # plain data, JSON and weights_only
    buffer.seek(0)
    resumed = StreamingLoader(cfg, 1, 2)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    tail = _take(resumed, total - split)
    for i, (a, b) in enumerate(zip(straight, head + tail, strict=True)):
        for key in ("tokens", "labels", "loss_mask"):
            assert torch.equal(a[key], b[key]), (i, key)
    # the split fell inside a document (a partly packed window was carried over)
    assert any(len(w["pending_tokens"]) > 1 for w in state["workers"].values())


def test_resume_refuses_another_layout(synth_shards):
    loader = StreamingLoader(_cfg(synth_shards), 0, 2)
    _take(loader, 2)
    with pytest.raises(DataError, match="dp_size=2, this loader has dp_size=1"):
        StreamingLoader(_cfg(synth_shards), 0, 1).load_state_dict(loader.state_dict())


def test_fixed_budget_gives_every_rank_the_same_batches(synth_shards):
    counts = {
        len(list(StreamingLoader(_cfg(synth_shards), r, 3, num_batches=17))) for r in range(3)
    }
    assert counts == {17}


# ---- bad data ------------------------------------------------------------------------------


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated-in-file":
        path.write_bytes(data[: 512 + 100])  # inside the first member's data
    elif how == "cut-at-header":
        path.write_bytes(data[:1024])  # ends right after a member, at a header boundary
    elif how == "garbage":
        path.write_bytes(bytes(range(256)) * (len(data) // 256))
    elif how == "missing":
        path.unlink()


@pytest.fixture
def shard_copy(synth_shards, tmp_path) -> Path:
    shutil.copytree(synth_shards.parent, tmp_path / "shards")
    return tmp_path / "shards" / "manifest.json"


@pytest.mark.parametrize("how", ["truncated-in-file", "cut-at-header", "garbage", "missing"])
def test_corrupt_shard_is_skipped_and_counted_or_fails_naming_it(shard_copy, how):
    manifest = read_manifest(str(shard_copy))
    victim = shard_copy.parent / manifest.shards[3].name
    _corrupt(victim, how)
    expected = len(_all_documents_except(shard_copy, victim.name))

    def run(on_error):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "del_megatron.data",
                str(shard_copy),
                "--seq-len",
                "64",
                "--on-error",
                on_error,
            ],
            capture_output=True,
            text=True,
            check=False,
        )

    skip = run("skip")
    assert skip.returncode == 0, skip.stderr
    report = json.loads(skip.stdout)
    assert report["skipped_shards"] == [str(victim)]
    loader = StreamingLoader(_cfg(shard_copy, epochs=1, on_error="skip", shuffle=False))
    eos = manifest.tokenizer.eos_id
    assert len(documents_of(*stream_of(list(loader)), eos)) == expected
    assert loader.skipped_shards == [str(victim)]

    fail = run("fail")
    assert fail.returncode == 2
    assert fail.stderr.count("\n") == 1 and victim.name in fail.stderr


def _all_documents_except(manifest_path: Path, name: str):
    manifest = read_manifest(str(manifest_path))
    return [
        d
        for e in manifest.shards
        if e.name != name
        for d in read_shard(resolve(str(manifest_path), e.name), e, allow_pipe=False)
    ]


def test_worker_errors_arrive_as_one_line(shard_copy):
    manifest = read_manifest(str(shard_copy))
    _corrupt(shard_copy.parent / manifest.shards[0].name, "garbage")
    with pytest.raises(DataError) as err:
        list(StreamingLoader(_cfg(shard_copy, num_workers=2, epochs=1, shuffle=False)))
    assert "\n" not in str(err.value) and manifest.shards[0].name in str(err.value)


def test_tokenizer_mismatch_is_refused(synth_shards):
    with pytest.raises(DataError, match="rebuild the shards with the training tokenizer"):
        StreamingLoader(_cfg(synth_shards), fingerprint="vocab-0000")


def test_missing_manifest_and_bad_manifest(tmp_path):
    with pytest.raises(DataError, match="nope/manifest.json: no such file"):
        StreamingLoader(_cfg(tmp_path / "nope" / "manifest.json"))
    bad = tmp_path / "manifest.json"
    bad.write_text('{"version": 1}')
    with pytest.raises(DataError, match="manifest.json: not a shard manifest"):
        StreamingLoader(_cfg(bad))


# ---- sources -------------------------------------------------------------------------------


def test_file_url_http_and_pipe_sources(synth_shards):
    local = _take(StreamingLoader(_cfg(synth_shards)), 5)
    file_url = _take(StreamingLoader(_cfg(f"file://{synth_shards}")), 5)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(synth_shards.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/manifest.json"
        over_http = _take(StreamingLoader(_cfg(url)), 5)
    finally:
        server.shutdown()
    pipe = f"pipe:cat {synth_shards.parent}/{{name}}"
    with pytest.raises(DataError, match="allow_pipe"):
        StreamingLoader(_cfg(pipe))
    piped = _take(StreamingLoader(_cfg(pipe, allow_pipe=True)), 5)
    for other in (file_url, over_http, piped):
        assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(local, other, strict=True))
