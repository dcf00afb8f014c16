"""Where a trial's memory peaks count from (`MemoryBaseline`): the steady state's peak, not the
one-off steps' (the FLOP count, compilation, cuDNN autotuning).

Shared by every engine's timed window and by the sweeper's memory probe
(`python -m gpuopt.processes.memory_probe`), so the peak the batch axis is fitted against is the peak a
trial reports.
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


# Why a CPU trial has no peak: the process's high-water mark, which cannot be reset, was set by
# earlier work (another configuration measured in a shared process) and this trial stayed below it.
SHARED_PEAK_NOTE = (
    "peak_memory_mb not measured: this process's peak RSS was set before the trial (another "
    "configuration measured in the same process) and cannot be reset on a CPU; a fresh-process "
    "trial measures it"
)


@dataclass(frozen=True)
class MemoryBaseline:
    """Where the window's memory metrics count from.

    CUDA: the allocator's peak statistics are reset by `window_starting` (after warm-up, just
    before the timed window), so `peak_mb` / `peak_reserved_mb` are the steady state's peaks, not
    the eager FLOP-count step's activations, compilation or cudnn.benchmark's trial workspaces.
    After a reset a peak starts at what is in use then: `release_cache` (before the warm-up steps)
    gives the blocks those one-off steps left cached back to the driver, so the reserved peak is
    what the warm-up and the window re-reserve (expandable_segments and compile show there).
    CPU: ru_maxrss is the process's high-water mark and cannot be reset: the peak is how far this
    trial raised it over the RSS at `take` (before the trial builds anything). Where the trial never
    raised it (earlier work in the same process set it higher: the race's shared process), the
    peak is unknown, not 0 (`unmeasured`)."""

    device: torch.device
    rss_before_mb: float  # the RSS at `take` (the high-water mark where the RSS is unreadable)
    high_water_before_mb: float = 0.0

    @classmethod
    def take(cls, device: torch.device) -> MemoryBaseline:
        high_water = peak_rss_mb()
        return cls(device, rss_mb() or high_water, high_water)

    def release_cache(self) -> None:
        """Give cached, unused device blocks back (outside the window: before the warm-up steps)."""
        from gpuopt.trial.policies import empty_device_cache

        empty_device_cache(self.device)

    def window_starting(self) -> None:
        """Reset the device's peak statistics: the peaks read afterwards are the window's."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_mb(self) -> float | None:
        """CUDA: the allocator's peak of allocated memory since `window_starting`; CPU: the peak
        RSS's growth since `take`; else None."""
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
        """Why `peak_mb` is None on a CPU (a note for the trial), else None."""
        if self.device.type == "cpu" and self.peak_mb() is None:
            return SHARED_PEAK_NOTE
        return None

    def peak_reserved_mb(self) -> float | None:
        """CUDA: the caching allocator's peak of reserved (allocated + cached) memory since
        `window_starting`, what the device must hold; None elsewhere."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device) / 2**20
        return None
