"""Where a trial's memory peaks count from (`MemoryBaseline`): the steady state's peak, not the
one-off steps' (the FLOP count, compilation, cuDNN autotuning). Shared by every engine's window
and the sweeper's memory probe, so the peak the batch axis is fitted against is a trial's.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def peak_rss_mb() -> float:
    """The process's peak resident set size so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def rss_mb() -> float | None:
    """The process's resident set size now (Linux: /proc/self/statm), None where unreadable."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * resource.getpagesize() / 2**20


SHARED_PEAK_NOTE = (
    "peak_memory_mb not measured: this process's peak RSS was set before the trial (another "
    "configuration measured in the same process) and cannot be reset on a CPU; a fresh-process "
    "trial measures it"
)


@dataclass(frozen=True)
class MemoryBaseline:
    """Where the window's memory metrics count from.

    CUDA: peak statistics are reset by `window_starting` (just before the window), and
    `release_cache` (before warm-up) hands back what one-off steps left cached, so the reserved
    peak is what warm-up and the window re-reserve. CPU: ru_maxrss cannot be reset: the peak is
    how far this trial raised it over the RSS at `take`; where earlier work in the process set it
    higher, the peak is unknown, not 0 (`unmeasured`)."""

    device: torch.device
    rss_before_mb: float  # the RSS at `take` (the high-water mark where the RSS is unreadable)
    high_water_before_mb: float = 0.0

    @classmethod
    def take(cls, device: torch.device) -> MemoryBaseline:
        high_water = peak_rss_mb()
        return cls(device, rss_mb() or high_water, high_water)

    def release_cache(self) -> None:
        """Give cached, unused device blocks back (before the warm-up steps)."""
        from gpuopt.trial.policies import empty_device_cache

        empty_device_cache(self.device)

    def window_starting(self) -> None:
        """Reset the device's peak statistics: the peaks read afterwards are the window's."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_mb(self) -> float | None:
        """CUDA: peak allocated since `window_starting`; CPU: peak RSS growth since `take`."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.device.type == "cpu":
            high_water = peak_rss_mb()
            if high_water <= self.high_water_before_mb:
                return None  # this trial stayed under a mark set before it: `unmeasured`
            return max(0.0, high_water - self.rss_before_mb)
        return None

    def unmeasured(self) -> str | None:
        """Why `peak_mb` is None on a CPU, else None."""
        if self.device.type == "cpu" and self.peak_mb() is None:
            return SHARED_PEAK_NOTE
        return None

    def peak_reserved_mb(self) -> float | None:
        """CUDA: peak reserved (allocated + cached) memory since `window_starting`, else None."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device) / 2**20
        return None
