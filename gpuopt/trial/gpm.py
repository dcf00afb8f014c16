"""NVML GPU Performance Monitoring (GPM) over the timed window: SM activity, occupancy, tensor-core
and DRAM activity (Hopper and newer).

NVML's `utilization.gpu` is the share of a period in which at least one kernel ran: one tiny
kernel at a time reads 100%. GPM reads the SMs' own counters: nvmlGpmMetricsGet turns two samples
into each metric's average between them. A sample at each end of the window, more every
`interval_s` in a long one, each segment weighted by its seconds; GPM refreshes its counters
every 100 ms, so a shorter segment is merged into its neighbour. A MIG instance is sampled
through its parent GPU. Where GPM is not there, `open_gpm` says why in one line and the metrics
stay null; no GPM call ever raises out of this module.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuopt.core.metrics import METRICS
from gpuopt.trial.monitor import PeriodicSampler

GPM_MIN_SEGMENT_S = 0.1  # NVML's GPM refresh: two samples closer than this read no new counters
GPM_INTERVAL_S = 1.0  # a long window's intermediate samples, this far apart
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_GPM_METRICS_GET_VERSION = 1
NULL_NOTE = "sm_active, sm_occupancy, tensor_active and dram_bw_util are null"


def gpm_fields() -> tuple[tuple[str, str], ...]:
    """(Metrics field, NVML_GPM_METRIC_* suffix) of every metric GPM reads (the catalogue's)."""
    return tuple((m.name, m.gpm) for m in METRICS if m.gpm)


@dataclass(frozen=True)
class GpmStats:
    """The window's GPM metrics (Metrics field -> %, None where NVML gave none) and why not."""

    values: dict[str, float | None]
    samples: int  # GPM samples taken over the window, its ends included
    window_s: float
    notes: tuple[str, ...] = ()


@dataclass
class _Taken:
    t: float  # time.perf_counter()
    sample: Any  # the NVML sample buffer


# Two samples' segment: (seconds, the metrics NVML computed for it, the others' nvmlReturn).
_Segment = tuple[float, dict[str, float], dict[str, int]]


def _error_code(exc: BaseException | None) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def why_not(nvml: Any, exc: BaseException | None, mig: bool = False) -> str:
    """One line: why GPM is not there, from the NVML error a GPM call raised (None: the device
    says it has no GPM)."""
    code = _error_code(exc)
    if code == NVML_ERROR_NO_PERMISSION:
        why = "no permission to read GPM counters (NVML_ERROR_NO_PERMISSION)"
    elif exc is None or code == NVML_ERROR_NOT_SUPPORTED:
        why = "GPM is not supported " + (
            "for this MIG instance" if mig else "on this GPU (Hopper and newer have it)"
        )
    else:
        why = f"GPM unavailable ({type(exc).__name__}: {exc})"
    return f"{why}: {NULL_NOTE}"


class GpmSampler(PeriodicSampler):
    """GPM samples of one device (or MIG instance) between start() and stop(), which gives the
    window's metrics and frees every buffer. `read(buffer)` fills a buffer (nvmlGpmSampleGet or
    nvmlGpmMigSampleGet)."""

    thread_name = "gpuopt-gpm"

    def __init__(
        self, nvml: Any, read: Callable[[Any], Any], interval_s: float = GPM_INTERVAL_S
    ) -> None:
        self.nvml, self._read, self.interval_s = nvml, read, interval_s
        self.taken: list[_Taken] = []
        self._notes: list[str] = []

    def sample(self) -> BaseException | None:
        """One sample now, appended to `taken`; the NVML error (also noted) when it refused."""
        try:
            buffer = self.nvml.nvmlGpmSampleAlloc()
        except Exception as exc:
            self._note(f"nvmlGpmSampleAlloc: {type(exc).__name__}: {exc}")
            return exc
        try:
            self._read(buffer)
        except Exception as exc:
            self._free(buffer)
            self._note(f"nvmlGpmSampleGet: {type(exc).__name__}: {exc}")
            return exc
        self.taken.append(_Taken(time.perf_counter(), buffer))
        return None

    def _note(self, note: str) -> None:
        if note not in self._notes:
            self._notes.append(note)

    def _free(self, buffer: Any) -> None:
        with contextlib.suppress(Exception):  # a buffer NVML will not free: nothing else to do
            self.nvml.nvmlGpmSampleFree(buffer)

    def start(self) -> None:
        self.taken, self._notes = [], []
        self._start_sampling()

    def discard(self) -> None:
        """Free the samples taken so far (none kept)."""
        for taken in self.taken:
            self._free(taken.sample)
        self.taken, self._notes = [], []

    def stop(self) -> GpmStats:
        self._stop_sampling()
        try:
            return self._stats()
        finally:
            self.discard()

    def _stats(self) -> GpmStats:
        kept = spaced(self.taken, GPM_MIN_SEGMENT_S)
        window_s = self.taken[-1].t - self.taken[0].t if len(self.taken) >= 2 else 0.0
        names = [name for name, _ in gpm_fields()]
        if len(kept) < 2:
            why = "; ".join(self._notes) or "fewer than two samples over the window"
            note = f"GPM unavailable ({why}): {NULL_NOTE}"
            return GpmStats(dict.fromkeys(names), len(self.taken), window_s, (note,))
        notes: list[str] = []
        segments = [self.segment(a, b) for a, b in itertools.pairwise(kept)]
        values: dict[str, float | None] = {}
        for name in names:
            weighted = [(seconds, found[name]) for seconds, found, _ in segments if name in found]
            total_s = sum(w for w, _ in weighted)
            values[name] = sum(w * v for w, v in weighted) / total_s if total_s > 0 else None
            if values[name] is None:
                codes = sorted({errors[name] for *_, errors in segments if name in errors})
                notes.append(f"GPM: {name} null (NVML returned {codes or 'no value'})")
        if window_s < GPM_MIN_SEGMENT_S:
            notes.append(
                f"GPM: the window ({window_s * 1e3:.0f} ms) is shorter than GPM's 100 ms "
                "refresh: its metrics read partly outside it"
            )
        return GpmStats(values, len(self.taken), window_s, tuple(notes))

    def segment(self, first: _Taken, second: _Taken) -> _Segment:
        """The metrics between two samples (nvmlGpmMetricsGet; sample1 is the earlier)."""
        fields = gpm_fields()
        request = self.nvml.c_nvmlGpmMetricsGet_t()
        request.version = NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(fields)
        request.sample1, request.sample2 = first.sample, second.sample
        for i, (_, gpm) in enumerate(fields):
            request.metrics[i].metricId = getattr(self.nvml, f"NVML_GPM_METRIC_{gpm}")
        seconds = second.t - first.t
        try:
            self.nvml.nvmlGpmMetricsGet(request)
        except Exception as exc:
            code = _error_code(exc) or -1
            return seconds, {}, {name: code for name, _ in fields}
        values, errors = {}, {}
        for i, (name, _) in enumerate(fields):
            metric = request.metrics[i]
            if metric.nvmlReturn == NVML_SUCCESS:
                values[name] = float(metric.value)
            else:
                errors[name] = int(metric.nvmlReturn)
        return seconds, values, errors


def spaced(taken: list[_Taken], min_s: float) -> list[_Taken]:
    """The samples that bound segments of at least `min_s`: the first, each one at least `min_s`
    after the last kept, and the last (replacing a kept one closer than `min_s` to it; a window
    shorter than `min_s` keeps both ends)."""
    if len(taken) < 2:
        return list(taken)
    kept = [taken[0]]
    for t in taken[1:-1]:
        if t.t - kept[-1].t >= min_s:
            kept.append(t)
    if len(kept) > 1 and taken[-1].t - kept[-1].t < min_s:
        kept.pop()
    return [*kept, taken[-1]]


def open_gpm(nvml: Any, handle: Any, interval_s: float = GPM_INTERVAL_S) -> tuple[Any, str | None]:
    """(a GpmSampler for the device behind `handle`, None), or (None, why not). Never raises."""
    if not hasattr(nvml, "nvmlGpmQueryDeviceSupport"):
        return None, f"this nvidia-ml-py has no GPM API (nvidia-ml-py >= 12): {NULL_NOTE}"
    try:
        mig = bool(nvml.nvmlDeviceIsMigDeviceHandle(handle))
    except Exception:  # a driver without MIG: a whole GPU
        mig = False
    try:
        if mig:
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            instance = nvml.nvmlDeviceGetGpuInstanceId(handle)
            support = nvml.nvmlGpmQueryDeviceSupport(parent)
            read = functools.partial(nvml.nvmlGpmMigSampleGet, parent, instance)
        else:
            support = nvml.nvmlGpmQueryDeviceSupport(handle)
            read = functools.partial(nvml.nvmlGpmSampleGet, handle)
    except Exception as exc:
        return None, why_not(nvml, exc, mig)
    if not getattr(support, "isSupportedDevice", 0):
        return None, why_not(nvml, None, mig)
    sampler = GpmSampler(nvml, read, interval_s)
    # A first read: the permission check (a profiler holding the counters, a container without
    # them) happens here, not at the window's start.
    refused = sampler.sample()
    sampler.discard()
    if refused is not None:
        return None, why_not(nvml, refused, mig)
    return sampler, None


def device_support(device: Any) -> tuple[bool, str | None]:
    """Whether the CUDA `device` has GPM, and why not: the env probe's `gpm` fact, which makes
    `sm_active` the default utilization objective. Never raises."""
    from gpuopt.trial import monitor

    try:
        nvml = monitor.import_nvml()
        handle = monitor.nvml_handle(nvml, device)
    except Exception as exc:
        return False, f"NVML unavailable ({type(exc).__name__}: {exc}): {NULL_NOTE}"
    sampler, why = open_gpm(nvml, handle)
    return sampler is not None, why
