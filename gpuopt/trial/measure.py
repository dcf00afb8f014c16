"""The timed window: step clocks, the stability stop, step-time statistics, model and hardware
FLOPs (MFU/HFU), and the steady state (the epoch boundary's cost, amortized).

On CUDA the host never synchronizes inside the window (that would serialize CPU and GPU): step
boundaries are CUDA events, and the host synchronizes only at the window's ends.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gpuopt.core.stats import t_quantile

if TYPE_CHECKING:
    import torch

# The CI uses up to this many batch means: consecutive step times are autocorrelated (allocator,
# thermal and frequency drift, loader bursts), so raw steps would understate the uncertainty.
CI_BATCHES = 10
MIN_CI_BATCHES = 5
MIN_BATCH_STEPS = 3  # a batch mean averages at least this many steps: no CI before 15 steps


@functools.lru_cache(maxsize=64)
def _t975(df: int) -> float:
    """Student's t 97.5% quantile, computed once per df: `t_quantile` inverts the CDF by bisection
    (~0.6 ms), which would otherwise be the stop rule's main cost inside the window."""
    return t_quantile(0.975, df)


def relative_ci_halfwidth(step_times: Sequence[float]) -> float | None:
    """Relative half-width of the 95% CI of the mean step time, from up to CI_BATCHES consecutive
    batch means (the earliest steps left over dropped); None below MIN_CI_BATCHES. Plain Python:
    ~10 us for 500 steps, inside the window."""
    n = len(step_times)
    count = min(CI_BATCHES, n // MIN_BATCH_STEPS)
    if count < MIN_CI_BATCHES:
        return None
    size = n // count
    first = n - count * size
    means = [
        sum(step_times[first + b * size : first + (b + 1) * size]) / size for b in range(count)
    ]
    mean = sum(means) / count
    if mean <= 0:
        return None
    sd = math.sqrt(sum((m - mean) ** 2 for m in means) / (count - 1))
    return _t975(count - 1) * sd / math.sqrt(count) / mean


@dataclass(frozen=True)
class StopRule:
    """When the timed window ends: stable (CI under target, after min_steps and min_time_s),
    budget, or max_steps. The CI only sees fluctuations shorter than the window: min_time_s keeps
    it long enough to contain slower ones (epoch restarts, allocator, GC)."""

    min_steps: int
    max_steps: int
    time_budget_s: float
    stability_target: float
    min_time_s: float = 0.0

    @classmethod
    def from_measure(cls, measure: Any) -> StopRule:
        return cls(
            measure.min_steps,
            measure.max_steps,
            measure.time_budget_s,
            measure.stability_target,
            min(measure.min_time_s, measure.time_budget_s),
        )

    def check(
        self, step_times: Sequence[float], elapsed_s: float, steps: int | None = None
    ) -> str | None:
        """`step_times`: the completed steps' times; `steps`: steps run (on CUDA some may still be
        queued)."""
        n = len(step_times) if steps is None else steps
        if n >= self.max_steps:
            return "max_steps"
        if n >= self.min_steps and elapsed_s >= self.min_time_s:
            ci = relative_ci_halfwidth(step_times)
            if ci is not None and ci < self.stability_target:
                return "stable"
        if elapsed_s >= self.time_budget_s and n >= 2:
            return "budget"
        return None


@dataclass(frozen=True)
class StepStats:
    median_ms: float
    p10_ms: float
    p90_ms: float
    cv: float


def step_stats(step_times_s: Sequence[float]) -> StepStats:
    times = np.asarray(step_times_s, dtype=float)
    mean = float(times.mean())
    cv = float(times.std(ddof=1) / mean) if len(times) > 1 and mean > 0 else 0.0
    p10, p50, p90 = np.percentile(times, [10, 50, 90]) * 1e3
    return StepStats(float(p50), float(p10), float(p90), cv)


class StepClock(Protocol):
    """Marks step boundaries; `completed_step_times` must not block (no device sync)."""

    def start(self) -> None: ...
    def mark(self) -> None: ...
    def completed_step_times(self) -> list[float]: ...
    def finish(self) -> tuple[list[float], float]: ...  # (step times, window wall seconds)


class HostClock:
    """CPU: the host's clock is the device's. On an asynchronous device without timing events
    (MPS), `sync` makes the window's ends exact; per-step times are then host-side."""

    def __init__(
        self, sync: Callable[[], None] | None = None, timer: Callable[[], float] = time.perf_counter
    ) -> None:
        self.sync, self.timer = sync, timer
        self.step_times: list[float] = []
        self._start = self._last = 0.0

    def start(self) -> None:
        if self.sync is not None:
            self.sync()
        self.step_times = []
        self._start = self._last = self.timer()

    def mark(self) -> None:
        now = self.timer()
        self.step_times.append(now - self._last)
        self._last = now

    def completed_step_times(self) -> list[float]:
        return list(self.step_times)

    def finish(self) -> tuple[list[float], float]:
        if self.sync is not None:
            self.sync()
            if self.step_times:  # the last step ends when the device is done
                now = self.timer()
                self.step_times[-1] += now - self._last
                self._last = now
        return self.completed_step_times(), self._last - self._start


class CudaEventClock:
    """CUDA: one event per step boundary on `device`'s own current stream (on cuda:0 they would
    time an idle GPU for cuda:N). Event-to-event times include GPU idle time waiting for the host:
    what a training step costs, not just its kernels. Each read queries only the events not yet
    seen complete, so the stop rule's checks cost O(new steps)."""

    def __init__(
        self, device: torch.device, event_factory: Callable[[], Any] | None = None
    ) -> None:
        import torch

        self._torch = torch
        self.device = device
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._last_done: Any = None  # the latest event known to be reached
        self._pending: deque[Any] = deque()  # recorded after it, not yet seen reached
        self._step_times: list[float] = []
        self._host_start = 0.0

    def _record(self) -> None:
        event = self._new_event()
        event.record(self._torch.cuda.current_stream(self.device))
        self._pending.append(event)

    def start(self) -> None:
        # Window boundary: a sync point, so queued warm-up work does not leak into the window.
        self._torch.cuda.synchronize(self.device)
        self._host_start = time.perf_counter()
        self._step_times, self._pending = [], deque()
        self._record()
        self._last_done = self._pending.popleft()  # the window's first boundary

    def mark(self) -> None:
        self._record()

    def completed_step_times(self) -> list[float]:
        # Events on one stream complete in order; query() and elapsed_time here do not block.
        while self._pending and self._pending[0].query():
            event = self._pending.popleft()
            self._step_times.append(self._last_done.elapsed_time(event) / 1e3)
            self._last_done = event
        return list(self._step_times)

    def finish(self) -> tuple[list[float], float]:
        # Window boundary: a sync point; everything the window queued has now run.
        self._torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._host_start
        return self.completed_step_times(), wall


def make_clock(device: torch.device) -> StepClock:
    if device.type == "cuda":
        return CudaEventClock(device)
    if device.type == "mps":
        return HostClock(sync=lambda: synchronize(device))
    return HostClock()


def synchronize(device: torch.device) -> None:
    """A CPU-GPU sync point: wait until the device finished everything queued so far."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class WindowResult:
    step_times: list[float]
    wall_s: float
    steps: int
    stop_reason: str
    first_step_at: float  # time.time() when the first timed step started
    extras: dict[str, Any] = field(default_factory=dict)
    steal_pct: float | None = None  # the hypervisor's share of the machine's CPU time (host.py)


# The stop rule's CI is read at min_steps and then each time the step count grew by 1/CHECK_SPACING
# (5%): a window stops at most max(1, n // CHECK_SPACING) steps after the step n at which it
# became stable; 500 steps read it ~90 times, ~1 ms in all (~10 us a read on CPU).
CHECK_SPACING = 20


def next_stop_check(steps: int) -> int:
    """The step count at which the stop rule is read next (the same on every rank: it counts
    steps, never time)."""
    return steps + max(1, steps // CHECK_SPACING)


# Dense (no sparsity) peak TFLOP/s per dtype from NVIDIA's datasheets. fp16/bf16/tf32 are tensor-core
# numbers with fp32 accumulation; fp32 is the non-tensor-core number (gpuopt's fp32 mode disables
# TF32). Matched against torch.cuda.get_device_name() in order, first match wins.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),  # SXM
    (r"H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (r"H100", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),  # SXM
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"V100.*PCIe", {"fp32": 14.0, "fp16": 112.0}),
    (r"V100", {"fp32": 15.7, "fp16": 125.0}),  # SXM2
    (r"\bT4\b", {"fp32": 8.1, "fp16": 65.0}),
    (r"RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
)


def peak_flops(device_name: str | None, precision_mode: str) -> float | None:
    """Documented dense peak FLOP/s of a device for a precision mode, or None when unknown (CPUs)."""
    if not device_name:
        return None
    for pattern, table in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            tflops = table.get(precision_mode)
            return tflops * 1e12 if tflops else None
    return None


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one counted step: `hardware` everything the device executed (checkpoint recompute
    included, for HFU), `model` the model's own (for MFU)."""

    hardware: float
    recompute: float = 0.0
    attention: float = 0.0  # of `hardware`: scaled-dot-product attention (forward and backward)

    @property
    def model(self) -> float:
        return self.hardware - self.recompute


def step_flop_counter() -> Any:
    """A FlopCounterMode that also tallies activation-checkpoint recompute in `recompute_flops`:
    ops inside a backward pass with grad mode on (the backward itself runs with grad mode off;
    torch.utils.checkpoint recomputes the forward under `enable_grad()`)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    class StepFlopCounter(FlopCounterMode):
        def __init__(self) -> None:
            super().__init__(display=False)
            self.recompute_flops = 0.0

        # FlopCounterMode's per-op hook (private to torch; the override only adds a tally).
        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            count = self.flop_registry.get(func_packet)
            if (
                count is not None
                and torch._C._current_graph_task_id() != -1
                and torch.is_grad_enabled()
            ):
                self.recompute_flops += float(count(*args, **kwargs, out_val=out))
            return super()._count_flops(func_packet, out, args, kwargs)

        def step_flops(self) -> StepFlops:
            counts = self.get_flop_counts().get("Global", {})
            attention = sum(n for op, n in counts.items() if "attention" in str(op))
            return StepFlops(float(self.get_total_flops()), self.recompute_flops, float(attention))

    return StepFlopCounter()


def measure_step_flops(run_forward_backward: Callable[[], None]) -> StepFlops:
    """FLOPs of one forward+backward (torch.utils.flop_counter), outside the timed window."""
    counter = step_flop_counter()
    with counter:
        run_forward_backward()
    return counter.step_flops()


def mfu_percent(
    flops_per_sample: float | None, throughput: float | None, peak: float | None
) -> float | None:
    if not flops_per_sample or not throughput or not peak:
        return None
    return 100.0 * flops_per_sample * throughput / peak


def epoch_overhead(first_fetch_s: float, steady_fetch_s: float) -> float:
    """What one epoch boundary costs beyond the steady state: the first fetch of a fresh epoch
    (worker start-up, an empty prefetch queue) less a steady-state fetch. Never negative."""
    return max(0.0, first_fetch_s - steady_fetch_s)


def amortized_throughput(
    throughput: float, step_s: float, epoch_steps: int | None, overhead_s: float | None
) -> float:
    """Throughput of a long run whose epochs are `epoch_steps` steps of `step_s` plus `overhead_s`
    at each boundary; the steady state's without an epoch length or overhead (exactly: epoch_s /
    epoch_s may round one ulp above 1)."""
    if not epoch_steps or not overhead_s or step_s <= 0:
        return throughput
    epoch_s = epoch_steps * step_s
    return throughput * epoch_s / (epoch_s + overhead_s)
