"""del-convert: Hugging Face <-> del-megatron weights.

    del-convert hf-to-megatron --hf DIR --out DIR --tp N
    del-convert megatron-to-hf --checkpoint DIR --out DIR [--dtype float32|bfloat16|float16]

A del-megatron weights directory holds model/tpNN.safetensors (one per tensor-parallel
rank), arch.json and the tokenizer; every training checkpoint contains one, and
`del-train ... init.megatron=DIR` or `init.hf=DIR` starts a run from such weights. The export
writes the model type the weights came from (arch.json) and, unless --dtype says otherwise,
the dtype they were trained in. Both read a tensor at a time and write the output directory
completely or not at all. Mistakes print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..arguments import positive_int
from ..caches import use_writable_caches
from ..errors import INTERRUPTED, UserError
from ..models.conversion import export_hf, hf_to_megatron, open_hf
from ..models.hf_config import ConversionError
from ..models.weight_files import DTYPES
from ..outputs import is_no_space, no_space


def hf_to_megatron_cmd(args: argparse.Namespace) -> str:
    print(f"del-convert: converting {args.hf} to {args.out}", flush=True)
    checkpoint, arch = open_hf(args.hf, divisible_by=args.divisible_by)
    try:
        arch.check_tensor_parallel(args.tp)
    except ValueError as err:
        raise ConversionError(f"--tp {args.tp}: {err}") from None
    hf_to_megatron(
        checkpoint,
        arch,
        args.out,
        tensor_parallel=args.tp,
        force=args.force,
        wait=args.wait_for_lock,
    )
    return f"{args.hf} -> {args.out}/model ({arch.family}, {args.tp} tensor-parallel shards)"


def megatron_to_hf_cmd(args: argparse.Namespace) -> str:
    print(f"del-convert: exporting {args.checkpoint} to {args.out}", flush=True)
    exported = export_hf(
        args.checkpoint, args.out, dtype=args.dtype, force=args.force, wait=args.wait_for_lock
    )
    out = str(args.out)
    if exported.tokenizer is None:  # weights written without one: nothing to tokenize with
        return (
            f"{args.checkpoint} -> {args.out} ({exported}; no tokenizer beside the weights: "
            "copy the run's tokenizer there as tokenizer.model or tokenizer.json)\n"
            f"next: transformers.AutoModelForCausalLM.from_pretrained({out!r}) loads it"
        )
    # checked before it was put in place (models/conversion.check_export): these load it
    return (
        f"{args.checkpoint} -> {args.out} ({exported}, tokenizer {exported.tokenizer})\n"
        f"next: transformers.AutoModelForCausalLM.from_pretrained({out!r}) and "
        f"AutoTokenizer.from_pretrained({out!r}) load it; del-eval {args.out} "
        "--heldout MANIFEST evaluates it"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="del-convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megatron", help="a Hugging Face checkpoint -> a weights directory")
    a.add_argument("--hf", type=Path, required=True, help="Hugging Face checkpoint directory")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    a.add_argument(
        "--divisible-by",
        type=positive_int,
        default=128,
        help="pad the vocabulary to a multiple of this x tp",
    )
    a.set_defaults(func=hf_to_megatron_cmd)
    b = sub.add_parser("megatron-to-hf", help="a checkpoint or weights directory -> Hugging Face")
    b.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a training checkpoint or hf-to-megatron output directory",
    )
    b.add_argument("--out", type=Path, required=True)
    b.add_argument(
        "--dtype", choices=sorted(DTYPES), help="weights dtype (default: the training dtype)"
    )
    b.set_defaults(func=megatron_to_hf_cmd)
    for sub_parser in (a, b):
        sub_parser.add_argument(
            "--force",
            action="store_true",
            help="write into an output directory that holds other files (they are kept)",
        )
        sub_parser.add_argument(
            "--wait-for-lock",
            action="store_true",
            help="another process writing the same output: wait for it (default: refuse)",
        )
    args = parser.parse_args(argv)
    try:
        use_writable_caches("del-convert")
        print(args.func(args))
    except UserError as err:
        print(f"del-convert {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the output is written whole or not at all: left as it was
        print(
            f"del-convert {args.command}: interrupted (Ctrl-C): --out left as it was",
            file=sys.stderr,
        )
        return INTERRUPTED
    except Exception as err:
        if is_no_space(err):  # safetensors and torch wrap it in their own errors
            print(f"del-convert {args.command}: error: {no_space(args.out)}", file=sys.stderr)
            return 2
        if isinstance(err, OSError):  # reading or writing a path the user gave
            message = f"{err.filename}: {err.strerror}"
            print(f"del-convert {args.command}: error: {message}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
