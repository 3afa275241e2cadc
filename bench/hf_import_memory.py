"""Host memory of importing a Hugging Face checkpoint at tensor parallel 2, per rank: the lazy
per-rank import (only the rank's slices, a tensor at a time) side by side with reading the
whole checkpoint first (the eager way: every tensor, the full fused copies, then the shard).

    python bench/hf_import_memory.py [--layers 4] [--dir /tmp/del-bench-hf]

Generates (once) a Llama checkpoint with Llama-2-7B's widths (hidden 4096, ffn 11008, 32
heads, 32000 tokens) and fewer layers, random bf16 in two safetensors files with an index,
as transformers writes them. Each measurement runs in a fresh process that resets its peak
RSS (/proc/self/clear_refs) after its imports and reads it (VmHWM) after the import: the
figure is the import's own peak, over the bytes of the rank's shard.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def arch_of(layers: int):
    from del_megatron.models.architecture import LlamaArchitecture

    return LlamaArchitecture(
        vocab_size=32000,
        hidden_size=4096,
        ffn_hidden_size=11008,
        num_layers=layers,
        num_attention_heads=32,
        num_query_groups=32,
        max_position_embeddings=4096,
    )


def generate(directory: Path, layers: int) -> None:
    import torch

    from del_megatron.models.hf_config import hf_config
    from del_megatron.models.hf_names import hf_shapes
    from del_megatron.models.weight_files import HFWriter

    if (directory / "config.json").is_file():
        return
    arch = arch_of(layers)
    shapes = hf_shapes(arch)
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    writer = HFWriter(directory, shard_bytes=total // 2 + 1)  # two files and an index
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.finish(hf_config(arch, "bfloat16"))


def peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(directory: Path, rank: int, world: int, mode: str) -> dict:
    """One rank's import in this process: its shard of every tensor, held as the model
    would hold it."""
    from del_megatron.models.hf_config import architecture_from_hf
    from del_megatron.models.hf_names import megatron_names
    from del_megatron.models.hf_tensors import rank_shard, reader_of
    from del_megatron.models.sharding import partition_of, split
    from del_megatron.models.weight_files import HFCheckpoint

    checkpoint = HFCheckpoint(directory)
    arch = architecture_from_hf(checkpoint.config)
    padded = arch.padded_vocab_size(world)
    names = megatron_names(arch)
    baseline = current_rss()
    peak_rss_reset()
    start = time.perf_counter()
    if mode == "lazy":  # each slice copied into memory of its own, as into a parameter
        shard = {
            n: rank_shard(checkpoint.read, n, arch, padded, rank, world).clone() for n in names
        }
    else:  # eager: the whole checkpoint, full fused tensors, then this rank's part
        from safetensors.torch import load_file

        tensors = {}
        for path in sorted(set(checkpoint.files.values())):
            tensors.update(load_file(str(path)))
        read = reader_of(tensors)
        full = {n: rank_shard(read, n, arch, padded, 0, 1) for n in names}
        shard = {n: split(t, partition_of(n), rank, world).clone() for n, t in full.items()}
    seconds = time.perf_counter() - start
    shard_bytes = sum(t.numel() * t.element_size() for t in shard.values())
    return {
        "rank": rank,
        "mode": mode,
        "shard_bytes": shard_bytes,
        "peak_increase": peak_rss() - baseline,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/del-bench-hf"))
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "WORLD", "MODE"), help="internal")
    args = parser.parse_args()
    if args.worker:
        rank, world, mode = args.worker
        print(json.dumps(measure(args.dir, int(rank), int(world), mode)))
        return
    generate(args.dir, args.layers)
    size = sum(p.stat().st_size for p in args.dir.glob("*.safetensors"))
    widths = f"{args.layers} layers at Llama-2-7B widths"
    print(f"checkpoint: {args.dir} ({size / 2**30:.2f} GiB, {widths}), tensor parallel 2")
    columns = ("rank", "shard", "lazy peak", "ratio", "eager peak", "ratio", "lazy/eager")
    print(" ".join(f"{c:>10}" for c in columns))
    for rank in range(2):
        results = {}
        for mode in ("lazy", "eager"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--dir",
                    str(args.dir),
                    "--worker",
                    str(rank),
                    "2",
                    mode,
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
        shard = results["lazy"]["shard_bytes"]
        lazy, eager = results["lazy"]["peak_increase"], results["eager"]["peak_increase"]
        row = (
            f"{rank}",
            f"{shard / 2**30:.2f} GiB",
            f"{lazy / 2**30:.2f} GiB",
            f"{lazy / shard:.2f}x",
            f"{eager / 2**30:.2f} GiB",
            f"{eager / shard:.2f}x",
            f"{lazy / eager:.2f}x",
        )
        print(" ".join(f"{c:>10}" for c in row))


if __name__ == "__main__":
    main()
