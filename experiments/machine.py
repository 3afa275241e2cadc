"""The machine a page was made on, as the pages print it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}"
