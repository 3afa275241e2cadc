"""del-convert: Hugging Face <-> del-megatron weights.

    del-convert hf-to-megatron --hf DIR --out DIR --tp N
    del-convert megatron-to-hf --checkpoint DIR --out DIR [--model-type llama|mistral|qwen2]

A del-megatron weights directory holds model/tpNN.safetensors (one per tensor-parallel
rank), arch.json and the tokenizer; every training checkpoint contains one, and
`del-train ... init.megatron=DIR` or `init.hf=DIR` starts a run from such weights.
Mistakes print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..models.hf import (
    ConversionError,
    architecture_from_hf,
    hf_config,
    hf_to_megatron,
    megatron_to_hf,
    read_hf_checkpoint,
    read_weights,
    shard_state,
    tokenizer_in,
    unshard_state,
    weights_tokenizer,
    write_hf_checkpoint,
    write_weights,
)


def hf_to_megatron_cmd(args: argparse.Namespace) -> None:
    config, tensors = read_hf_checkpoint(args.hf)
    arch = architecture_from_hf(config, divisible_by=args.divisible_by)
    arch.check_tensor_parallel(args.tp)
    full = hf_to_megatron(tensors, arch, arch.padded_vocab_size(args.tp))
    shards = [shard_state(full, r, args.tp) for r in range(args.tp)]
    write_weights(args.out, shards, arch, tokenizer_in(args.hf))
    print(f"{args.hf} -> {args.out}/model ({args.tp} tensor-parallel shards)")


def megatron_to_hf_cmd(args: argparse.Namespace) -> None:
    arch, shards = read_weights(args.checkpoint)
    tensors = megatron_to_hf(unshard_state(shards), arch)
    tokenizer = weights_tokenizer(args.checkpoint)
    write_hf_checkpoint(
        args.out,
        hf_config(arch, args.model_type),
        tensors,
        tokenizer_dir=tokenizer.parent if tokenizer else None,
    )
    print(f"{args.checkpoint} -> {args.out} ({args.model_type})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="del-convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megatron")
    a.add_argument("--hf", type=Path, required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--tp", type=int, default=1)
    a.add_argument(
        "--divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this x tp",
    )
    a.set_defaults(func=hf_to_megatron_cmd)
    b = sub.add_parser("megatron-to-hf")
    b.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a training checkpoint or hf-to-megatron output directory",
    )
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--model-type", default="llama", choices=["llama", "mistral", "qwen2"])
    b.set_defaults(func=megatron_to_hf_cmd)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ConversionError, ValueError) as err:
        print(f"del-convert {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
