"""What a profiled window's Chrome trace says: the per-step phase breakdown (from gpuopt's
`gpuopt:*` spans), the GPU's time split (on CUDA) and the top operators.

HolisticTraceAnalysis computes the same temporal and idle breakdowns, but version 0.5.0 requires
jupyterlab, pytest, pandas, networkx and pydot at run time: too heavy for a trial process, so the
split is computed here with the same definitions.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPAN_PREFIX = "gpuopt:"
STEP_SPAN = "gpuopt:step"
PHASES = ("data_wait", "h2d_copy", "forward", "backward", "optimizer", "other")
# GPU event categories in a Kineto trace.
KERNEL_CATEGORIES = ("kernel",)
MEMORY_CATEGORIES = ("gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass
class OperatorTime:
    name: str
    self_s: float  # self time per step (host; device time on CUDA when `device_s` is set)
    share: float  # % of the step time
    device_s: float | None = None  # self device time per step (CUDA)


@dataclass
class GpuTimeSplit:
    """The GPU's time over the profiled steps, in % of that span (HolisticTraceAnalysis' terms)."""

    kernel: float  # some kernel running (union over streams)
    memcpy: float  # a memcpy/memset running and no kernel
    idle: float  # nothing running
    host_wait: float  # idle, the next op not launched yet (CPU-bound / launch-bound)
    kernel_wait: float  # idle, the next op launched but not started (launch latency, deps)
    unattributed_idle: float  # idle before an op whose launch is not in the trace
    busy_by_phase: dict[str, float] = field(default_factory=dict)  # % of busy time, by launcher


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The trace's events (a Chrome trace: {"traceEvents": [...]}, gzipped when *.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        return list(json.load(f).get("traceEvents") or [])


def _spans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpuopt's complete ("X") host spans."""
    return [
        e
        for e in events
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(SPAN_PREFIX) and "dur" in e
    ]


# The spans the engines annotate (`Annotation.span`), each with the phase its self time (its
# duration less the gpuopt spans nested in it) counts for.
SPAN_PHASES = {
    "next_batch": "data_wait",
    "h2d_copy": "h2d_copy",
    "forward": "forward",
    "forward_backward": "backward",  # native: forward_backward less forward = loss + backward
    "backward": "backward",  # Lightning: its backward hook
    "optimizer": "optimizer",  # Lightning: optimizer_step less the closure's forward/backward
}


def _self_times(spans: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(span name, self microseconds) for each span, children found by nesting on each thread."""
    result: list[tuple[str, float]] = []
    by_thread: dict[Any, list[dict[str, Any]]] = {}
    for e in spans:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list[Any]] = []  # [end, name, self time]
        for e in thread:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                _, name, own = stack.pop()
                result.append((name, own))
            if stack:
                stack[-1][2] -= dur
            stack.append([start + dur, e["name"], dur])
        result += [(name, own) for _, name, own in stack]
    return result


def phase_breakdown(events: list[dict[str, Any]]) -> tuple[int, float, dict[str, float]]:
    """(steps, mean step seconds, seconds per step by phase): each phase span's self time, and
    `other` the rest of the step spans."""
    spans = _spans(events)
    steps = [e for e in spans if e["name"] == STEP_SPAN]
    if not steps:
        raise ValueError(f"no {STEP_SPAN} span in the trace: nothing was profiled")
    phases_us = dict.fromkeys(PHASES, 0.0)
    for name, own in _self_times([e for e in spans if e["name"] != STEP_SPAN]):
        phase = SPAN_PHASES.get(name[len(SPAN_PREFIX) :])
        if phase is not None:
            phases_us[phase] += max(0.0, own)
    n = len(steps)
    step_us = sum(float(e["dur"]) for e in steps) / n
    per_step = {k: v / n for k, v in phases_us.items() if k != "other"}
    per_step["other"] = max(0.0, step_us - sum(per_step.values()))
    return n, step_us / 1e6, {k: per_step[k] / 1e6 for k in PHASES}


Interval = tuple[float, float]


def interval(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, merged; zero-length intervals are kept (they split idle gaps, `_idle_split`)."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _innermost_phase(spans: list[dict[str, Any]], ts: float) -> str:
    """The phase of the innermost gpuopt span holding host time `ts` (launches: "other" when none)."""
    holding = [e for e in spans if e["ts"] <= ts <= e["ts"] + e["dur"] and e["name"] != STEP_SPAN]
    if not holding:
        return "other"
    name = min(holding, key=lambda e: e["dur"])["name"][len(SPAN_PREFIX) :]
    return SPAN_PHASES.get(name, "other")


def _idle_split(
    busy: list[Interval], starts: dict[float, float | None], window: Interval
) -> tuple[float, float, float]:
    """(host wait, kernel wait, unattributed) microseconds of the gaps before each busy interval:
    host wait until the op that ends it was launched, kernel wait after."""
    host = kernel = unknown = 0.0
    previous_end = window[0]
    for start, end in busy:
        gap = start - previous_end
        if gap > 0:
            launched = starts.get(start)
            if launched is None:
                unknown += gap
            else:
                waited = min(max(0.0, launched - previous_end), gap)
                host += waited
                kernel += gap - waited
        previous_end = max(previous_end, end)
    tail = window[1] - previous_end
    return host + max(0.0, tail), kernel, unknown


def gpu_time_split(events: list[dict[str, Any]]) -> GpuTimeSplit | None:
    """The GPU's kernel/memcpy/idle shares over the profiled steps, idle split by each op's launch
    (the runtime event of its correlation id), busy time by the phase that launched it. None
    without GPU ops."""
    gpu_ops = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES + MEMORY_CATEGORIES
    ]
    spans = _spans(events)
    steps = [e for e in spans if e["name"] == STEP_SPAN]
    if not gpu_ops or not steps:
        return None
    launches = {
        (e.get("args") or {}).get("correlation"): float(e["ts"])
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "ts" in e
    }
    ends = (float(e["ts"] + e["dur"]) for e in steps + gpu_ops)
    window = (min(float(e["ts"]) for e in steps), max(ends))
    span = window[1] - window[0]
    kernels = union([interval(e) for e in gpu_ops if e["cat"] == "kernel"])
    busy = union([interval(e) for e in gpu_ops])
    # Each busy interval starts with some op: its launch decides the gap before it.
    launch_of_op_at: dict[float, float | None] = {}
    for e in sorted(gpu_ops, key=lambda e: e["ts"]):
        correlation = (e.get("args") or {}).get("correlation")
        launch_of_op_at.setdefault(float(e["ts"]), launches.get(correlation))
    first_launch = {start: launch_of_op_at.get(start) for start, _ in busy}
    host, kernel_wait, unknown = _idle_split(busy, first_launch, window)
    by_phase: dict[str, float] = {}
    for e in gpu_ops:
        launched = launches.get((e.get("args") or {}).get("correlation"))
        phase = _innermost_phase(spans, launched) if launched is not None else "other"
        by_phase[phase] = by_phase.get(phase, 0.0) + float(e["dur"])
    busy_total = sum(by_phase.values()) or 1.0

    def pct(us: float) -> float:
        return 100.0 * us / span if span > 0 else 0.0

    return GpuTimeSplit(
        kernel=pct(length(kernels)),
        memcpy=pct(length(busy) - length(kernels)),
        idle=pct(span - length(busy)),
        host_wait=pct(host),
        kernel_wait=pct(kernel_wait),
        unattributed_idle=pct(unknown),
        busy_by_phase={
            p: 100.0 * by_phase[p] / busy_total for p in (*PHASES, "other") if p in by_phase
        },
    )


def top_operators(
    averages: Any, steps: int, step_s: float, limit: int, cuda: bool
) -> list[OperatorTime]:
    """The operators with the most self time per step (device time on CUDA); annotation spans
    are phases, not operators, and are left out."""
    rows = []
    for avg in averages:
        name = str(avg.key)
        if name.startswith((SPAN_PREFIX, "ProfilerStep", "Optimizer.")):
            continue
        host_s = avg.self_cpu_time_total / 1e6 / steps
        device_s = avg.self_device_time_total / 1e6 / steps if cuda else None
        rows.append((device_s if cuda else host_s, name, host_s, device_s))
    rows.sort(reverse=True)
    return [
        OperatorTime(name, host_s, 100.0 * (key / step_s) if step_s else 0.0, device_s)
        for key, name, host_s, device_s in rows[:limit]
    ]
