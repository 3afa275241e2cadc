"""`data-tools` (or `python -m data_tools`): tokenizer, synth, tasks, build, inspect.

Errors in the input (a missing file, a wrong field, a damaged record, a bad tokenizer) print
one line naming the file and place or the field, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from del_megatron.arguments import (
    non_negative_int,
    positive_float,
    positive_int,
    progress_bars,
)
from del_megatron.caches import use_writable_caches
from del_megatron.errors import INTERRUPTED, UserError

from .readers import Fields


def _fields(args: argparse.Namespace) -> Fields:
    return Fields(text=args.text_field, prompt=args.prompt_field, response=args.response_field)


def _add_fields(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text-field", default="text", help="JSON/parquet field of the text")
    parser.add_argument(
        "--prompt-field",
        help="instruction data: field of the prompt (masked); its tokens come right before the "
        "response's, nothing added between (end the prompt with the separator you want)",
    )
    parser.add_argument("--response-field", help="instruction data: field of the response")


def cmd_tokenizer(args: argparse.Namespace) -> None:
    from .tokenizer_train import train_tokenizer

    path = train_tokenizer(
        args.inputs, args.output, vocab_size=args.vocab_size, fields=_fields(args), style=args.style
    )
    print(f"tokenizer written: {path}")


def cmd_synth(args: argparse.Namespace) -> None:
    from .synth import write_corpus

    train, held = write_corpus(
        args.output, documents=args.documents, heldout=args.heldout, seed=args.seed
    )
    print(f"corpus written: {train} ({args.documents} documents), {held} ({args.heldout})")


def cmd_tasks(args: argparse.Namespace) -> None:
    from .tasks import write_tasks

    meta = write_tasks(args.output, documents=args.documents, heldout=args.heldout, seed=args.seed)
    print(
        f"task suite written: {meta.parent} ({args.documents} documents, {args.heldout} "
        "held-out problems a task)"
    )


def cmd_build(args: argparse.Namespace) -> None:
    from .build import build_shards

    manifest = build_shards(
        args.inputs,
        args.output,
        args.tokenizer,
        fields=_fields(args),
        shard_bytes=int(args.shard_mb * 2**20),
        workers=args.workers,
        progress=progress_bars(args.quiet),
        on_error=args.on_error,
        force=args.force,
        wait_for_lock=args.wait_for_lock,
    )
    print(
        f"{len(manifest.shards)} shards, {manifest.documents} documents, "
        f"{manifest.tokens} tokens -> {args.output}"
    )
    for entry in manifest.inputs:
        if entry.skipped:
            print(f"skipped {entry.skipped} damaged records of {entry.name}: {entry.damage[0]}")


def cmd_inspect(args: argparse.Namespace) -> None:
    from .inspect import inspect_shards

    stats = inspect_shards(args.manifest, args.tokenizer, args.samples)
    print(json.dumps(stats, indent=1, ensure_ascii=False))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="data-tools", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tokenizer", help="train a tokenizer for numbers (digits split or grouped)")
    t.add_argument("inputs", nargs="+", type=Path)
    t.add_argument(
        "-o", "--output", type=Path, required=True, help="the .model / tokenizer.json to write"
    )
    t.add_argument(
        "--style",
        choices=["sentencepiece", "llama3"],
        default="sentencepiece",
        help="sentencepiece .model splitting digits, or a byte-level BPE tokenizer.json with "
        "Llama-3's pre-tokenizer (digits grouped 1..3, every such string a token)",
    )
    t.add_argument("--vocab-size", type=positive_int, default=4000)
    _add_fields(t)
    t.set_defaults(func=cmd_tokenizer)

    s = sub.add_parser("synth", help="write a deterministic math-heavy corpus")
    s.add_argument("-o", "--output", type=Path, required=True, help="directory")
    s.add_argument("--documents", type=positive_int, default=20000)
    s.add_argument("--heldout", type=non_negative_int, default=500)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_synth)

    n = sub.add_parser(
        "tasks", help="write the numeric task suite (data_tools/tasks.py): train and held-out"
    )
    n.add_argument("-o", "--output", type=Path, required=True, help="directory")
    n.add_argument("--documents", type=positive_int, default=20000)
    n.add_argument("--heldout", type=positive_int, default=200, help="problems a task")
    n.add_argument("--seed", type=int, default=0)
    n.set_defaults(func=cmd_tasks)

    b = sub.add_parser("build", help="tokenize corpus files into webdataset shards")
    b.add_argument("inputs", nargs="+", type=Path, help="files or directories")
    b.add_argument("-o", "--output", type=Path, required=True, help="shard directory")
    b.add_argument(
        "--tokenizer",
        type=Path,
        required=True,
        help="sentencepiece .model or Hugging Face tokenizer.json / directory",
    )
    b.add_argument("--shard-mb", type=positive_float, default=64.0, help="target shard size in MiB")
    b.add_argument(
        "--workers",
        type=non_negative_int,
        default=1,
        help="tokenizer processes (0: tokenize in this process)",
    )
    b.add_argument(
        "--on-error",
        choices=["fail", "skip"],
        default="fail",
        help="a damaged record or file: stop naming it (fail, the default), or leave it out, "
        "count it in the manifest and say so (skip)",
    )
    b.add_argument(
        "--force",
        action="store_true",
        help="build into a directory that holds files data-tools did not write (kept)",
    )
    b.add_argument(
        "--wait-for-lock",
        action="store_true",
        help="another build writing the same output: wait for it (default: refuse)",
    )
    b.add_argument(
        "--quiet", action="store_true", help="no progress bar (nor when stderr is no terminal)"
    )
    _add_fields(b)
    b.set_defaults(func=cmd_build)

    i = sub.add_parser("inspect", help="documents, tokens, digit share, number lengths")
    i.add_argument("manifest", type=Path, help="manifest.json, or the shard directory")
    i.add_argument(
        "--tokenizer",
        type=Path,
        help="to count digit tokens and decode samples (default: the manifest's tokenizer "
        "file, when found beside the shards)",
    )
    i.add_argument("--samples", type=non_negative_int, default=1, help="documents to show decoded")
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        use_writable_caches("data-tools")
        args.func(args)
    except UserError as err:
        print(f"data-tools {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outputs are written whole or not at all: left as they were
        print(f"data-tools {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
