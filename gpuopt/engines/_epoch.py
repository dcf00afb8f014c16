"""Steady state: what an epoch boundary costs (a fresh epoch's worker start-up, sampler and first
batch), measured after the window and amortized over the user's real epoch length. The timed
window never straddles an epoch restart (`_batches.steady_sampler`): the cost comes back in here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gpuopt.core.result import Metrics
from gpuopt.core.spec import TrialSpec
from gpuopt.engines._batches import dataset_length, stop_workers
from gpuopt.trial.measure import amortized_throughput, epoch_overhead


@dataclass(frozen=True)
class EpochBoundary:
    first_fetch_s: float | None  # a fresh epoch's iter() to its first batch
    steady_fetch_s: float  # the window's mean host fetch wait per step
    epoch_steps: int | None  # the user's real steps per epoch (None: an endless stream)


def real_epoch_steps(spec: TrialSpec, dataset_len: int | None) -> int | None:
    """The user's steps per epoch: `data.epoch_steps`, else the dataset's length / batch size."""
    explicit = spec.data.get("epoch_steps")
    if explicit:
        return int(explicit)
    if not dataset_len:
        return None
    batch = spec.loader.batch_size
    steps = dataset_len // batch if spec.loader.drop_last else -(-dataset_len // batch)
    return max(1, steps)


def time_epoch_start(loader: Any) -> float:
    """Host seconds from a fresh epoch's `iter(loader)` to its first batch; the epoch's workers
    are stopped after it unless they persist."""
    persistent = bool(getattr(loader, "persistent_workers", False))
    if persistent and getattr(loader, "_iterator", None) is None:
        # Between real epochs persistent workers are alive (e.g. Lightning stopped them at the
        # fit's end): start them, untimed, so the timed boundary resumes them.
        next(iter(loader))
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    seconds = time.perf_counter() - started
    if not persistent:
        stop_workers(iterator)
    return seconds


def measure_epoch_boundary(
    spec: TrialSpec, loader: Any, fetch_wait_s: float, steps: int
) -> EpochBoundary:
    """The epoch boundary's cost for `loader` (the caller stopped its non-persistent workers)."""
    first_fetch = time_epoch_start(loader) if hasattr(loader, "__iter__") else None
    length = dataset_length(getattr(loader, "dataset", None))
    return EpochBoundary(first_fetch, fetch_wait_s / max(1, steps), real_epoch_steps(spec, length))


def record_steady_state(m: Metrics, boundary: EpochBoundary) -> None:
    """epoch_overhead_s, epoch_steps and throughput_amortized (over the user's epoch length)."""
    if m.throughput is None or not m.timed_steps or not m.timed_seconds:
        return
    if boundary.first_fetch_s is not None:
        m.epoch_overhead_s = epoch_overhead(boundary.first_fetch_s, boundary.steady_fetch_s)
    m.epoch_steps = boundary.epoch_steps
    m.throughput_amortized = amortized_throughput(
        m.throughput, m.timed_seconds / m.timed_steps, boundary.epoch_steps, m.epoch_overhead_s
    )
