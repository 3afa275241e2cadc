"""What the checkpoint checksums (del_megatron/checksums.py) cost: writing a file through
HashingWriter against a plain write (the layout-free state's path: hashed as written), and
hashing a file that is in the page cache (the files hashed at the end of a save, and the
verification at a load), in GB/s of one process.

    .venv/bin/python bench/checkpoint_checksums.py [--mb 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from del_megatron.checksums import HashingWriter, hash_file

CHUNK = 16 << 20  # a parameter's bytes as checkpoint/optim_state.py writes them


def write(path: Path, data: bytes, total: int, hashed: bool) -> float:
    start = time.perf_counter()
    with open(path, "wb") as raw:
        handle = HashingWriter(raw) if hashed else raw
        for _ in range(total // len(data)):
            handle.write(data)
        raw.flush()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="file size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    total = args.mb << 20
    data = os.urandom(CHUNK)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.safetensors"
        plain, hashed, read = [], [], []
        for _ in range(args.repeats):  # alternating, the minimum of each
            plain.append(write(path, data, total, hashed=False))
            hashed.append(write(path, data, total, hashed=True))
            start = time.perf_counter()
            hash_file(path)
            read.append(time.perf_counter() - start)
    gb = total / 1e9
    print(f"{args.mb} MiB file, minimum of {args.repeats}")
    print(f"plain write (page cache)         {gb / min(plain):6.2f} GB/s")
    print(f"write through HashingWriter      {gb / min(hashed):6.2f} GB/s")
    print(f"  added per GB written           {(min(hashed) - min(plain)) / gb:6.3f} s")
    print(f"hash_file (page cache)           {gb / min(read):6.2f} GB/s")


if __name__ == "__main__":
    main()
