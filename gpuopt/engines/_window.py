"""What is read beside the timed window (whose state machine is gpuopt.engines._meter's): the NVML
sampler (`WindowMonitors`), the input pipeline's cost (`InputWait`), and the window's metrics
(`record_window`). torch is imported inside functions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuopt.core.result import Metrics
from gpuopt.trial.measure import (
    StepFlops,
    WindowResult,
    mfu_percent,
    peak_flops,
    relative_ci_halfwidth,
    step_stats,
)

if TYPE_CHECKING:
    import torch

    from gpuopt.trial.context import Trial
    from gpuopt.trial.memory import MemoryBaseline
    from gpuopt.trial.profiled_window import ProfileSummary


class WindowMonitors:
    """The NVML sampler and, on GPUs with GPM (Hopper and newer), the GPM sampler running beside
    the timed window (none where NVML or GPM is absent: a note says why)."""

    def __init__(self, device: torch.device, interval_s: float, notes: list[str]) -> None:
        self.device, self.interval_s, self.notes = device, interval_s, notes
        self._sampler: Any = None
        self._gpm: Any = None

    def _say(self, note: str | None) -> None:
        if note and note not in self.notes:
            self.notes.append(note)

    def start(self) -> None:
        from gpuopt.trial import gpm, monitor

        sampler, note = monitor.open_sampler(self.device, self.interval_s)
        self._say(note)
        self._sampler = sampler
        if sampler is None:
            return
        sampler.start()
        self._gpm, note = gpm.open_gpm(sampler.nvml, sampler.handle)
        self._say(note)
        if self._gpm is not None:
            self._gpm.start()  # last: its first sample is the window's start

    def stop(self) -> Any:
        """The window's `NvmlStats` (its `gpm` the GPM metrics), or None without a sampler; their
        notes join the trial's. Callable more than once (the window's end, a failure's clean-up)."""
        gpm_sampler, self._gpm = self._gpm, None
        gpm_stats = gpm_sampler.stop() if gpm_sampler is not None else None  # first: the end
        sampler, self._sampler = self._sampler, None
        stats = sampler.stop() if sampler is not None else None
        if stats is not None and gpm_stats is not None:
            stats = dataclasses.replace(stats, gpm=gpm_stats)
        for note in [*(getattr(stats, "notes", ()) or ()), *getattr(gpm_stats, "notes", ())]:
            self._say(note)
        return stats


@dataclass(frozen=True)
class InputWaitSeconds:
    """What the input pipeline cost the timed window, in seconds."""

    device_s: float  # the device starved of input (CUDA: on the GPU timeline; else = host_s)
    host_s: float  # the host blocked in next(loader)


class InputWait:
    """What the input pipeline costs the loop inside the timed window, from the fetch
    (`next(loader)`) and host-to-device copy spans each engine marks: `host_s`, host time blocked
    fetching, and `device_s`, time the device sat starved of input. On CUDA that is read on the
    GPU timeline: an event recorded on the stream when the fetch starts (reached once the previous
    step's queued work is done) to one after the copy, so loader time that overlaps queued compute
    costs nothing, whatever syncs the step makes and however the engine copies. Without CUDA
    events it is the host's fetch time, the same thing on a synchronous device. Marks count only
    while `active` (the window meter's window). `record_event`: tests' stand-in."""

    def __init__(
        self,
        device: torch.device,
        record_event: Callable[[], Any] | None = None,
        host_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if record_event is None and device.type == "cuda":
            import torch

            def record_event() -> Any:
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(device))
                return event

        self._record_event = record_event
        self._host_clock = host_clock
        self.fetch_s = 0.0
        self._fetch_t0: float | None = None
        self._spans: list[tuple[Any, Any]] = []  # (fetch started, copy ended) events
        self._span_start: Any = None
        self.active = True

    def reset(self) -> None:
        self.fetch_s, self._fetch_t0, self._spans, self._span_start = 0.0, None, [], None

    def _open_span(self) -> None:
        if self.active and self._record_event is not None and self._span_start is None:
            self._span_start = self._record_event()

    def fetch_started(self) -> None:
        if self.active:
            self._fetch_t0 = self._host_clock()
            self._open_span()

    def fetch_ended(self) -> None:
        if self.active and self._fetch_t0 is not None:
            self.fetch_s += self._host_clock() - self._fetch_t0
            self._fetch_t0 = None

    def copy_started(self) -> None:
        self._open_span()  # a step whose batch was fetched earlier (prefetched) starts here

    def copy_ended(self) -> None:
        if self.active and self._span_start is not None:
            self._spans.append((self._span_start, self._record_event()))  # type: ignore[misc]
            self._span_start = None

    def totals(self) -> InputWaitSeconds:
        """The totals since the reset (after the window's closing synchronize: an event's elapsed
        time is defined once both were reached)."""
        if self._record_event is None:
            return InputWaitSeconds(device_s=self.fetch_s, host_s=self.fetch_s)
        device_ms = sum(start.elapsed_time(end) for start, end in self._spans)
        return InputWaitSeconds(device_s=device_ms / 1e3, host_s=self.fetch_s)


def record_window(
    m: Metrics,
    window: WindowResult,
    samples: int,
    input_wait: InputWaitSeconds,
    device: torch.device,
    nvml: Any,
    memory: MemoryBaseline,
    precision_mode: str | None,
    process_t0: float,
) -> None:
    """The timed window's metrics (every engine), after the window's closing synchronize."""
    import torch

    m.timed_steps, m.timed_seconds, m.stop_reason = window.steps, window.wall_s, window.stop_reason
    m.compute_dtype = precision_mode
    m.throughput = samples / window.wall_s
    m.startup_time_s = window.first_step_at - process_t0
    stats = step_stats(window.step_times)
    m.step_time_ms, m.step_time_p10_ms, m.step_time_p90_ms = (
        stats.median_ms,
        stats.p10_ms,
        stats.p90_ms,
    )
    m.step_time_cv = stats.cv
    m.throughput_ci = relative_ci_halfwidth(window.step_times)
    m.cpu_steal_pct = window.steal_pct
    m.data_wait = min(100.0, 100.0 * input_wait.device_s / window.wall_s)
    m.host_data_wait = min(100.0, 100.0 * input_wait.host_s / window.wall_s)
    peak_memory = memory.peak_mb()
    if peak_memory is not None:
        m.peak_memory_mb = peak_memory
    m.peak_reserved_mb = memory.peak_reserved_mb()
    apply_device_monitor(m, device.type, nvml, samples)
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_flops(device_label, precision_mode) if precision_mode else None
    m.mfu = mfu_percent(m.flops_per_sample, m.throughput, peak)
    hardware_flops = m.hardware_flops_per_sample or m.flops_per_sample
    m.hfu = mfu_percent(hardware_flops, m.throughput, peak)


def apply_device_monitor(m: Metrics, device_type: str, nvml: Any, samples: int) -> None:
    """Utilization, power and energy: NVML's numbers (null where NVML is absent) and GPM's
    activities where the GPU has it; on CPU, utilization = 100 - data_wait."""
    if device_type == "cpu":
        m.utilization = None if m.data_wait is None else 100.0 - m.data_wait
        return
    m.utilization = nvml.utilization if nvml is not None else None
    gpm = getattr(nvml, "gpm", None)
    for name, value in (gpm.values if gpm is not None else {}).items():
        setattr(m, name, value)
    m.power_w = nvml.power_w if nvml is not None else None
    m.utilization_source = getattr(nvml, "utilization_source", None)
    m.power_source = getattr(nvml, "power_source", None)
    energy = nvml.energy_j if nvml is not None else None
    m.energy_per_sample_j = energy / samples if energy is not None and samples else None


def attention_tf32_note(
    peak_mode: str | None, capability: tuple[int, int] | None, flops: StepFlops
) -> str | None:
    """A note for fp32 MFU of a model with attention on sm80+: PyTorch's memory-efficient attention
    (the SDPA kernel fp32 gets; flash and cuDNN attention take fp16/bf16 only) runs its matmuls on
    tensor cores for fp32 there, whatever allow_tf32 says, while mfu is against the non-tensor-core
    fp32 peak."""
    if peak_mode != "fp32" or capability is None or capability < (8, 0) or not flops.attention:
        return None
    share = 100.0 * flops.attention / flops.hardware if flops.hardware else 0.0
    return (
        f"precision fp32 with attention ({share:.0f}% of the counted FLOPs): PyTorch's "
        "memory-efficient attention uses tensor cores for fp32 on sm80+ regardless of allow_tf32, "
        "so mfu (against the fp32 non-tensor-core peak) overstates the fp32 math's share"
    )


def record_flops(trial: Trial, flops: StepFlops, samples: int, peak_mode: str | None) -> None:
    """flops_per_sample from one counted step of `samples` (every engine), and what its MFU must
    be read with: tensor-core attention under fp32 (CUDA sm80+)."""
    import torch

    if flops.hardware and samples:
        trial.metrics.flops_per_sample = flops.model / samples
        trial.metrics.hardware_flops_per_sample = flops.hardware / samples
    device = trial.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    attention = attention_tf32_note(peak_mode, capability, flops)
    if attention:
        trial.warnings.append(attention)


def record_profile(trial: Trial, summary: ProfileSummary) -> None:
    """The profiled window's summary, and a distributed rank's communication share."""
    trial.profile = summary.to_dict()
    if summary.comm is not None:
        m = trial.metrics
        m.comm_share, m.comm_exposed = summary.comm.comm_pct, summary.comm.exposed_pct
        m.comm_overlapped = summary.comm.overlapped_pct
