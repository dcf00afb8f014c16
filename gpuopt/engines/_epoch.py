"""Steady state, measured after the window by both engines (`beside_window`): what an epoch boundary
costs (a fresh epoch's worker start-up, sampler and first batch), amortized over the user's real
epoch length, and the input pipeline's cost per sample. The timed window never straddles an epoch
restart (`_batches.steady_sampler`): the cost comes back in here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuopt.core.spec import TrialSpec
from gpuopt.engines._batches import dataset_length, stop_workers
from gpuopt.engines._ceiling import measure_loader_cost
from gpuopt.trial.measure import amortized_throughput, epoch_overhead

if TYPE_CHECKING:
    from gpuopt.trial.context import Trial


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


def beside_window(
    trial: Trial, loader: Any, fetch_wait_s: float, stop_workers: Callable[[], None]
) -> float | None:
    """After the window: epoch_overhead_s (a fresh epoch of `loader` against the window's fetch
    wait per step; `stop_workers()` stops the window's workers first unless they persist, as
    between real epochs), epoch_steps and throughput_amortized over the user's epoch length, then
    the input pipeline's cost per sample (`measure.loader_cost`). `loader` None: not measured."""
    m, spec = trial.metrics, trial.spec
    with trial.phase("boundary"):
        if not getattr(loader, "persistent_workers", False):
            stop_workers()
        first_fetch = time_epoch_start(loader) if loader is not None else None
        stop_workers()
    length = dataset_length(getattr(loader, "dataset", None))
    epoch_steps = real_epoch_steps(spec, length) if loader is not None else None
    if m.throughput is not None and m.timed_steps and m.timed_seconds:
        if first_fetch is not None:
            m.epoch_overhead_s = epoch_overhead(first_fetch, fetch_wait_s / m.timed_steps)
        m.epoch_steps = epoch_steps
        m.throughput_amortized = amortized_throughput(
            m.throughput, m.timed_seconds / m.timed_steps, epoch_steps, m.epoch_overhead_s
        )
    if loader is None or not spec.measure.loader_cost:
        return None
    with trial.phase("loader_cost"):
        return measure_loader_cost(loader)
