"""Resume on another layout without losing anything (CPU, gloo): an epoch interrupted twice,
each time at another data-parallel size, loader worker count and ZeRO stage, trains every
document of the epoch exactly once, and ends within 1e-3 of an uninterrupted run's held-out
loss on the same global batch."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import pytest

from ..utils import logged_steps
from .test_resume import start_ranks, train_args

pytestmark = pytest.mark.slow

GLOBAL_BATCH, SEQ_LEN = 16, 128


def epoch_documents(manifest: Path) -> dict[tuple[int, int], int]:
    """(shard, sample) -> tokens + its EOS, from the shards' own records."""
    from del_megatron.data.format import read_manifest, read_shard, resolve

    found = read_manifest(str(manifest))
    out = {}
    for shard, entry in enumerate(found.shards):
        for sample, doc in enumerate(
            read_shard(resolve(str(manifest), entry.name), entry, allow_pipe=False)
        ):
            out[(shard, sample)] = len(doc.tokens) + 1
    return out


def steps_past_the_epoch(documents: dict[tuple[int, int], int]) -> int:
    """Steps that take every slot past the epoch: slots read shards of unequal sizes, so some
    reach the next epoch before others finish this one."""
    return math.ceil(1.3 * sum(documents.values()) / (GLOBAL_BATCH * SEQ_LEN))


def segment(args: list[str], nproc: int, *, stop_after: int | None, out: Path) -> tuple[int, str]:
    """Run del-train on `nproc` ranks; with stop_after, SIGUSR1 to the last rank once the
    metrics show that step. Returns the step the segment ended at."""
    ranks = start_ranks(args, nproc)
    metrics = out / "metrics.jsonl"
    if stop_after is not None:
        deadline = time.time() + 600
        while True:
            steps = logged_steps(metrics)
            if steps and max(steps) >= stop_after:
                break
            assert time.time() < deadline and all(r.poll() is None for r in ranks)
            time.sleep(0.05)
        ranks[-1].send_signal(signal.SIGUSR1)
    outputs = [r.communicate(timeout=600)[0] for r in ranks]
    codes = [r.returncode for r in ranks]
    assert codes == [75 if stop_after is not None else 0] * nproc, outputs[0][-3000:]
    saved = sorted((out / "checkpoints").glob("step-*"))
    return int(saved[-1].name.split("-")[1]), outputs[0]


def test_epoch_interrupted_twice_at_other_layouts_trains_every_document_once(
    tmp_path, synth_tokenizer, synth_shards, synth_corpus
):
    from data_tools.build import build_shards

    heldout = tmp_path / "heldout"
    build_shards([synth_corpus / "heldout.jsonl"], heldout, synth_tokenizer, progress=False)
    documents = epoch_documents(synth_shards)
    steps = steps_past_the_epoch(documents)

    def args(out: Path, *extra: str) -> list[str]:
        return train_args(
            out,
            synth_tokenizer,
            synth_shards,
            f"train.steps={steps}",
            f"train.global_batch_size={GLOBAL_BATCH}",
            f"train.seq_len={SEQ_LEN}",
            f"eval.sources=[{{manifest: {heldout / 'manifest.json'}}}]",
            "eval.max_batches=4",
            "loss.normalize=tokens",
            f"data.trace={out / 'trace'}",
            *extra,
            tp=1,
        )

    def held_out_loss(log: str) -> float:
        """The final table's held-out objective after training (4 decimals)."""
        row = [x for x in log.splitlines() if x.startswith("held-out loss (")][-1]
        return float(row.split()[-1])

    straight = tmp_path / "straight"
    _, straight_log = segment(
        [*args(straight, "data.num_workers=1")], 2, stop_after=None, out=straight
    )

    out = tmp_path / "interrupted"
    first, _ = segment([*args(out, "data.num_workers=1")], 2, stop_after=steps // 3, out=out)
    second, log = segment(
        [*args(out, "data.num_workers=2", "parallel.zero_stage=2"), "--resume", "auto"],
        1,
        stop_after=first + steps // 3,
        out=out,
    )
    assert f"at step {first}" in log and "data-parallel size 2 -> 1" in log, log[-3000:]
    assert first < second < steps
    last, log = segment(
        [*args(out, "data.num_workers=0"), "--resume", "auto"], 2, stop_after=None, out=out
    )
    assert last == steps and f"at step {second}" in log, log[-3000:]

    from del_megatron.data.trace import trained

    tokens = trained(out / "trace")
    manifest = str(synth_shards)
    epoch0 = {(s, d): n for (m, e, s, d), n in tokens.items() if e == 0}
    assert all(m == manifest for m, *_ in tokens), set(m for m, *_ in tokens)
    assert epoch0 == documents  # every document of the epoch, all of its tokens, once
    later = {k: n for k, n in tokens.items() if k[1] > 0}
    assert all(n <= documents[(s, d)] for (_, _, s, d), n in later.items())  # none twice
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))
    assert abs(held_out_loss(log) - held_out_loss(straight_log)) <= 1e-3
