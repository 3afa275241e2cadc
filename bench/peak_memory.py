"""Peak memory of a piece of work, the same way in every benchmark."""

from __future__ import annotations

import re

import torch


class PeakMemory:
    """Bytes allocated at peak above the level at `reset` (CPU: peak RSS; GPU: allocator)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _rss_kib(self, field: str) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak RSS to the current RSS
            self.base = self._rss_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._rss_kib("VmHWM") * 1024 - self.base
