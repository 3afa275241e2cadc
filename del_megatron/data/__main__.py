"""`python -m del_megatron.data MANIFEST [MANIFEST ...]`: stream the shards through the loader
once (one epoch, one rank) and report what was read. A corrupt shard stops the run with one
line naming it (exit status 2); with --on-error skip it is left out and counted."""

from __future__ import annotations

import argparse
import json
import sys

from ..arguments import positive_int
from ..errors import UserError
from .config import DataConfig, DataSource
from .loader import StreamingLoader


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m del_megatron.data", description=__doc__)
    p.add_argument("manifests", nargs="+")
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument(
        "--on-error",
        choices=["skip", "fail"],
        default="fail",
        help="a corrupt shard: stop (fail, the default) or leave it out and count it (skip)",
    )
    p.add_argument("--allow-pipe", action="store_true")
    args = p.parse_args(argv)
    cfg = DataConfig(  # argparse checked every value
        sources=tuple(DataSource(manifest=m) for m in args.manifests),
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        on_error=args.on_error,
        shuffle=False,
        allow_pipe=args.allow_pipe,
        epochs=1,
    )
    try:
        loader = StreamingLoader(cfg)
        batches = tokens = 0
        for batch in loader:
            batches += 1
            tokens += int(batch["loss_mask"].sum())
    except UserError as err:
        print(f"python -m del_megatron.data: error: {err}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {"batches": batches, "trained_tokens": tokens, "skipped_shards": loader.skipped_shards}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
