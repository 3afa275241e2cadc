"""Hashes of the loader's batches, saved states and resume lines over nine configurations,
to compare two trees when a refactor must keep behaviour bit-identical:

    PYTHONPATH=TREE_A python -m tests.data.batch_hashes /tmp/corpora > a.txt
    PYTHONPATH=TREE_B python -m tests.data.batch_hashes /tmp/corpora > b.txt
    diff a.txt b.txt

The first run builds the corpora (three sources, one copy with an unreadable shard) in the
directory; later runs reuse them. Configurations: straight, workers with finite epochs,
mask_after_boundary without shuffle, reshards dp 2 -> 3 x 2 workers -> 1 (finite and
streaming), the same slot count at another layout, a mix change, a skipped shard, slots in
two epochs at a change. A tool, not a test: its hashes depend on the tokenizer's build.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

CORPORA = (("many", 300, 16), ("few", 120, 100), ("other", 150, 16))  # name, documents, KB


def build(root: Path) -> None:
    from data_tools.build import build_shards
    from data_tools.tokenizer_train import train_tokenizer
    from del_megatron.data import read_manifest

    rng = np.random.default_rng(1)
    root.mkdir(parents=True, exist_ok=True)
    for name, count, _ in CORPORA:
        lines = [
            json.dumps(
                {
                    "text": f"{name} "
                    + " ".join(map(str, rng.integers(0, 10**6, rng.integers(3, 40))))
                }
            )
            for _ in range(count)
        ]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    tokenizer = root / "tok" / "tokenizer.model"
    tokenizer.parent.mkdir(exist_ok=True)
    train_tokenizer([root / "many.jsonl", root / "few.jsonl"], tokenizer, vocab_size=300)
    for name, _, kb in CORPORA:
        build_shards(
            [root / f"{name}.jsonl"], root / name, tokenizer, shard_bytes=kb << 10, progress=False
        )
    shutil.copytree(root / "many", root / "broken")
    victim = read_manifest(str(root / "broken" / "manifest.json")).shards[4].name
    (root / "broken" / victim).write_bytes(b"garbage" * 100)


def main(root: Path) -> None:
    from del_megatron.data import DataConfig, DataSource, StreamingLoader

    if not (root / "broken").exists():
        build(root)
    manifests = {n: str(root / n / "manifest.json") for n in ("many", "few", "other", "broken")}

    def cfg(sources: list[tuple[str, float]], **overrides: Any) -> DataConfig:
        fields: dict[str, Any] = dict(seq_len=32, micro_batch_size=2, seed=5)
        fields.update(overrides)
        return DataConfig(
            sources=[DataSource(manifest=manifests[m], weight=w) for m, w in sources], **fields
        )

    hashes: dict[str, Any] = {}

    def add(name: str, value: Any) -> None:
        digest = hashes.setdefault(name, hashlib.sha256())
        if isinstance(value, dict) and "tokens" in value:
            for key in ("tokens", "labels", "loss_mask"):
                digest.update(value[key].numpy().tobytes())
        else:
            digest.update(json.dumps(value, sort_keys=True).encode())

    def run(name: str, segments: list[tuple[DataConfig, int, int | None]]) -> None:
        """Each segment: every rank takes `take` batches (None: to the end), saves, takes 2
        more (lost), and the next segment resumes the saved states."""
        states = None
        for config, dp_size, take in segments:
            loaders = []
            for rank in range(dp_size):
                loader = StreamingLoader(config, rank, dp_size)
                if states is not None:
                    add(name, loader.resume(states))
                loaders.append(loader)
            iterators = [iter(loader) for loader in loaders]
            if take is None:
                for batches in iterators:
                    for batch in batches:
                        add(name, batch)
                add(name, [loader.state_dict() for loader in loaders])
                return
            for batches in iterators:
                for _ in range(take):
                    add(name, next(batches))
            saved = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
            add(name, saved)
            for batches in iterators:
                for _ in range(2):
                    add(name, next(batches))
                batches.close()
            states = [state for state in saved for _ in range(2)]  # tensor-parallel copies

    two = [("many", 0.7), ("few", 0.3)]
    broken = [("broken", 0.7), ("few", 0.3)]
    run("straight-dp2", [(cfg(two), 2, 12)])
    run("workers-finite-dp3", [(cfg(two, epochs=1, num_workers=2), 3, None)])
    run("mask-noshuffle", [(cfg(two, mask_after_boundary=True, shuffle=False, epochs=2), 2, None)])
    run(
        "reshard-finite",
        [
            (cfg(two, epochs=1), 2, 9),
            (cfg(two, epochs=1, num_workers=2), 3, 6),
            (cfg(two, epochs=1), 1, None),
        ],
    )
    run(
        "reshard-stream",
        [(cfg(two), 2, 9), (cfg(two, num_workers=2), 3, 6), (cfg(two, micro_batch_size=8), 1, 60)],
    )
    run("same-slots", [(cfg(two), 2, 4), (cfg(two, num_workers=2), 1, 10)])
    run(
        "mix-change",
        [
            (cfg([("many", 0.5), ("few", 0.5)], epochs=1), 2, 8),
            (cfg([("other", 0.5), ("many", 0.5)], epochs=1), 2, 6),
            (cfg([("other", 0.5), ("many", 0.2)], epochs=1), 2, None),
        ],
    )
    run(
        "skip",
        [
            (cfg(broken, epochs=1, on_error="skip"), 3, 10),
            (cfg(broken, epochs=1, on_error="skip", num_workers=2), 2, 5),
            (cfg(broken, epochs=1, on_error="skip"), 3, None),
        ],
    )
    run(
        "epochs2-slots",
        [
            (cfg([("few", 1.0)], epochs=2), 2, 140),
            (cfg([("few", 1.0)], epochs=2, num_workers=2), 3, 20),
            (cfg([("few", 1.0)], epochs=2), 1, None),
        ],
    )
    for name, digest in hashes.items():
        print(name, digest.hexdigest()[:16])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
