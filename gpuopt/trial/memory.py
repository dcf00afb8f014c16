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


@dataclass(frozen=True)
class MemoryBaseline:
    """Where the window's memory metrics count from.

    CUDA: the allocator's peak statistics are reset by `window_starting` (after warm-up, just
    before the timed window), so `peak_mb` / `peak_reserved_mb` are the steady state's peaks, not
    the eager FLOP-count step's activations, compilation or cudnn.benchmark's trial workspaces.
    After a reset a peak starts at what is in use then: `release_cache` (before the warm-up steps)
    gives the blocks those one-off steps left cached back to the driver, so the reserved peak is
    what the warm-up and the window re-reserve (expandable_segments and compile show there).
    CPU: ru_maxrss is the process's high-water mark and cannot be reset: the peak RSS's growth
    from `take` (before the trial builds anything)."""

    device: torch.device
    rss_before_mb: float

    @classmethod
    def take(cls, device: torch.device) -> MemoryBaseline:
        return cls(device, peak_rss_mb())

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
            return max(0.0, peak_rss_mb() - self.rss_before_mb)
        return None

    def peak_reserved_mb(self) -> float | None:
        """CUDA: the caching allocator's peak of reserved (allocated + cached) memory since
        `window_starting`, what the device must hold; None elsewhere."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device) / 2**20
        return None
