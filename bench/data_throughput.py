"""Data path throughput, each figure next to its baseline from the same run.

    python bench/data_throughput.py [--documents 30000] [--seq-len 2048] [--batch 8]

1. Loader: tokens/s of StreamingLoader (one process: read shards, check, shuffle, pack into
   seq_len+1 windows, batch into tensors) next to reading the same documents from
   megatron-core's mmap IndexedDataset (.bin/.idx) into one array.
2. Build: tokens/s of `data_tools build` with one worker next to a plain single-process
   sentencepiece encode loop over the same texts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data_tools.build import build_shards
from data_tools.synth import write_corpus
from data_tools.tokenizer_train import train_tokenizer
from del_megatron.data import DataConfig, DataSource, StreamingLoader, read_manifest
from del_megatron.data.format import read_shard, resolve


def best_of(repeats: int, fn) -> tuple[float, object]:
    """Shortest wall time of `repeats` calls (and the last result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=30000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="del-bench-data-"))
    train, _ = write_corpus(root / "corpus", documents=args.documents, heldout=1, seed=0)
    tokenizer = train_tokenizer([train], root / "tokenizer.model", vocab_size=4000)
    texts = [json.loads(line)["text"] for line in train.read_text().splitlines()]

    # ---- build vs plain encode loop (alternating, best of repeats)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    plain_time, n_tokens = best_of(args.repeats, lambda: sum(len(sp.encode(t)) for t in texts))
    build_time, manifest = best_of(
        args.repeats,
        lambda: build_shards([train], root / "shards", tokenizer, workers=1, progress=False),
    )
    assert manifest.tokens == n_tokens

    # ---- loader vs megatron IndexedDataset
    manifest_path = root / "shards" / "manifest.json"
    docs = [
        d.tokens
        for e in read_manifest(str(manifest_path)).shards
        for d in read_shard(resolve(str(manifest_path), e.name), e, allow_pipe=False)
    ]
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    prefix = str(root / "megatron")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in docs:
        builder.add_document(doc.astype(np.int32), [len(doc)])
    builder.finalize(prefix + ".idx")

    def read_indexed():
        dataset = IndexedDataset(prefix, mmap=True)
        return int(sum(len(dataset[i]) for i in range(len(dataset))))

    windows_tokens = args.batch * args.seq_len
    batches = manifest.tokens // windows_tokens
    cfg = DataConfig(
        sources=[DataSource(manifest=str(manifest_path))],
        seq_len=args.seq_len,
        micro_batch_size=args.batch,
    )

    def read_loader():
        return sum(
            int(b["tokens"].numel())
            for _, b in zip(range(batches), StreamingLoader(cfg), strict=False)
        )

    indexed_time, indexed_tokens = best_of(args.repeats, read_indexed)
    loader_time, loader_tokens = best_of(args.repeats, read_loader)

    print(
        f"{args.documents} synthetic documents, {manifest.tokens} tokens, "
        f"{len(manifest.shards)} shards; windows {args.batch} x {args.seq_len}"
    )
    print(f"{'':44s} {'M tokens/s':>10s} {'ratio':>7s}")
    rows = [
        ("megatron IndexedDataset, read all documents", indexed_tokens / indexed_time, None),
        (
            "StreamingLoader, packed batches",
            loader_tokens / loader_time,
            indexed_tokens / indexed_time,
        ),
        ("plain sentencepiece encode loop", n_tokens / plain_time, None),
        ("data_tools build, 1 worker", n_tokens / build_time, n_tokens / plain_time),
    ]
    for name, rate, base in rows:
        ratio = f"{rate / base:6.3f}x" if base else "  1.000x"
        print(f"{name:44s} {rate / 1e6:10.2f} {ratio:>7s}")


if __name__ == "__main__":
    main()
