"""What a profiled window's Chrome trace says: the per-step phase breakdown (from gpuopt's
`gpuopt:*` spans), the GPU's time split (on CUDA), the top operators, and a distributed rank's
communication split (`comm_time`).

HolisticTraceAnalysis computes the same temporal and idle breakdowns, but version 0.5.0 requires
jupyterlab, pytest, pandas, networkx and pydot at run time: too heavy for a trial process, so the
split is computed here with the same definitions.

The communication split: how much of the step a collective was in flight, and how much of that
the training thread was blocked on it (exposed) rather than computing beside it (overlapped). What
torch names the collectives (measured on torch 2.13: a 2-rank gloo DDP and FSDP2 on CPU; the NCCL
names from torch's profiler documentation and issues, not measured here):

- gloo runs each collective on its own worker threads: a `user_annotation` span `gloo:all_reduce`,
  `gloo:all_gather`, ... from pick-up to completion, waiting for the peers included. The training
  thread only enqueues it, in a `cpu_op` `c10d::allreduce_`, `c10d::_allgather_base_`, ...
  (FSDP2's reduce-scatter is a `gloo:all_reduce` under gloo).
- The training thread's waits have no event of their own (DDP's reducer finalize, FSDP2's
  `FSDP::all_gather_copy_out` / `FSDP::post_backward_reduce`): no operator runs while it waits.
- NCCL runs on the GPU: kernels `ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)` (older NCCL:
  `ncclKernel_...`) on its own stream.

Host basis (gloo): in flight = the collective spans on other threads and the training thread's
own `c10d::*` operators; busy = the training thread's innermost event is a (non-collective)
`cpu_op`; exposed = in flight and not busy (an upper bound: Python between operators counts).
GPU basis (NCCL): in flight = the NCCL kernels, busy = any other kernel or memcpy, over
`gpu_time_split`'s window (HolisticTraceAnalysis' comm/compute overlap).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPAN_PREFIX = "gpuopt:"
STEP_SPAN = "gpuopt:step"
PHASES = ("data_wait", "h2d_copy", "forward", "backward", "optimizer", "other")
# GPU event categories in a Kineto trace.
KERNEL_CATEGORIES = ("kernel",)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
GLOO_PREFIX = "gloo:"  # ProcessGroupGloo's spans on its worker threads
# The training thread's own communication: enqueueing a collective, or running one itself.
HOST_COMM_PREFIXES = (
    "c10d::",
    "_c10d_functional::",
    "c10d_functional::",
    "record_param_comms",
    GLOO_PREFIX,
    "nccl:",
)

Event = dict[str, Any]
Interval = tuple[float, float]


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


@dataclass
class CommTime:
    """One rank's collectives over its profiled steps: seconds per step and % of the step."""

    basis: str  # "host" (gloo: the training thread's view) | "gpu" (NCCL kernels vs compute)
    comm_s: float  # a collective in flight
    exposed_s: float  # ... while the training thread (GPU: the device) did nothing else
    overlapped_s: float  # ... while it computed
    comm_pct: float
    exposed_pct: float
    overlapped_pct: float
    by_collective_s: dict[str, float] = field(default_factory=dict)  # in flight, by collective


def load_trace(path: str | Path) -> list[Event]:
    """The trace's events (a Chrome trace: {"traceEvents": [...]}, gzipped when *.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        return list(json.load(f).get("traceEvents") or [])


def _complete(events: list[Event]) -> list[Event]:
    """The complete ("X") events with a start and a duration."""
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _spans(events: list[Event]) -> list[Event]:
    """gpuopt's complete host spans."""
    return [e for e in _complete(events) if str(e.get("name", "")).startswith(SPAN_PREFIX)]


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


def _span_phase(e: Event, parent: Any = None) -> str | None:
    return SPAN_PHASES.get(str(e["name"])[len(SPAN_PREFIX) :])


def _by_thread(events: list[Event]) -> dict[Any, list[Event]]:
    threads: dict[Any, list[Event]] = {}
    for e in events:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    return threads


def _innermost(
    thread: list[Event], label_of: Callable[[Event, Any], Any]
) -> dict[Any, list[Interval]]:
    """One thread's time (µs) by the label of its innermost event, events nested by start and
    duration (one running past its parent's end clipped there); `label_of(event, parent label)`."""
    found: dict[Any, list[Interval]] = {}
    stack: list[tuple[float, Any]] = []  # (end, label)
    cursor: float | None = None

    def advance(to: float) -> None:
        nonlocal cursor
        if cursor is not None and to > cursor and stack:
            found.setdefault(stack[-1][1], []).append((cursor, to))
        cursor = to if cursor is None else max(cursor, to)

    for e in sorted(thread, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        start, end = interval(e)
        while stack and stack[-1][0] <= start:
            advance(stack[-1][0])
            stack.pop()
        advance(start)
        if stack:
            end = min(end, stack[-1][0])
        stack.append((end, label_of(e, stack[-1][1] if stack else None)))
    while stack:
        advance(stack[-1][0])
        stack.pop()
    return found


def phase_breakdown(events: list[Event]) -> tuple[int, float, dict[str, float]]:
    """(steps, mean step seconds, seconds per step by phase): each phase span's self time, and
    `other` the rest of the step spans."""
    spans = _spans(events)
    steps = [e for e in spans if e["name"] == STEP_SPAN]
    if not steps:
        raise ValueError(f"no {STEP_SPAN} span in the trace: nothing was profiled")
    phases_us = dict.fromkeys(PHASES, 0.0)
    for thread in _by_thread([e for e in spans if e["name"] != STEP_SPAN]).values():
        for phase, segments in _innermost(thread, _span_phase).items():
            if phase is not None:
                phases_us[phase] += length(segments)
    n = len(steps)
    step_us = sum(float(e["dur"]) for e in steps) / n
    per_step = {k: v / n for k, v in phases_us.items() if k != "other"}
    per_step["other"] = max(0.0, step_us - sum(per_step.values()))
    return n, step_us / 1e6, {k: per_step[k] / 1e6 for k in PHASES}


def interval(e: Event) -> Interval:
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


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Two sorted, merged interval lists' common time."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _gpu_window(steps: list[Event], gpu_ops: list[Event]) -> Interval:
    """From the first step's start to the last step's or GPU op's end."""
    return min(float(e["ts"]) for e in steps), max(interval(e)[1] for e in steps + gpu_ops)


def _innermost_phase(spans: list[Event], ts: float) -> str:
    """The phase of the innermost gpuopt span holding host time `ts` (launches: "other" when none)."""
    holding = [e for e in spans if e["ts"] <= ts <= e["ts"] + e["dur"] and e["name"] != STEP_SPAN]
    if not holding:
        return "other"
    return _span_phase(min(holding, key=lambda e: e["dur"])) or "other"


def _idle_split(
    busy: list[Interval], launch_at: dict[float, float | None], window: Interval
) -> tuple[float, float, float]:
    """(host wait, kernel wait, unattributed) microseconds of the gaps before each busy interval:
    host wait until the op that starts it was launched, kernel wait after."""
    host = kernel = unknown = 0.0
    previous_end = window[0]
    for start, end in busy:
        gap = start - previous_end
        if gap > 0:
            launched = launch_at.get(start)
            if launched is None:
                unknown += gap
            else:
                waited = min(max(0.0, launched - previous_end), gap)
                host += waited
                kernel += gap - waited
        previous_end = max(previous_end, end)
    tail = window[1] - previous_end
    return host + max(0.0, tail), kernel, unknown


def gpu_time_split(events: list[Event]) -> GpuTimeSplit | None:
    """The GPU's kernel/memcpy/idle shares over the profiled steps, idle split by each op's launch
    (the runtime event of its correlation id), busy time by the phase that launched it. None
    without GPU ops."""
    gpu_ops = [e for e in _complete(events) if e.get("cat") in GPU_CATEGORIES]
    spans = _spans(events)
    steps = [e for e in spans if e["name"] == STEP_SPAN]
    if not gpu_ops or not steps:
        return None
    launches = {
        (e.get("args") or {}).get("correlation"): float(e["ts"])
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "ts" in e
    }
    window = _gpu_window(steps, gpu_ops)
    span = window[1] - window[0]
    kernels = union([interval(e) for e in gpu_ops if e["cat"] in KERNEL_CATEGORIES])
    busy = union([interval(e) for e in gpu_ops])
    # Each busy interval starts with some op (the earliest at its start): its launch decides the gap.
    launch_at: dict[float, float | None] = {}
    by_phase: dict[str, float] = {}
    for e in sorted(gpu_ops, key=lambda e: e["ts"]):
        launched = launches.get((e.get("args") or {}).get("correlation"))
        launch_at.setdefault(float(e["ts"]), launched)
        phase = _innermost_phase(spans, launched) if launched is not None else "other"
        by_phase[phase] = by_phase.get(phase, 0.0) + float(e["dur"])
    host, kernel_wait, unknown = _idle_split(busy, launch_at, window)
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
        busy_by_phase={p: 100.0 * by_phase[p] / busy_total for p in PHASES if p in by_phase},
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


# -- a distributed rank's communication ------------------------------------------------------------
def _is_nccl_kernel(e: Event) -> bool:
    return e.get("cat") in KERNEL_CATEGORIES and str(e.get("name", "")).lower().startswith("nccl")


def collective_name(name: str) -> str:
    """`gloo:all_reduce` -> all_reduce; `ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)` ->
    all_reduce; `ncclKernel_AllGather_RING_LL_Sum_int8_t(...)` -> all_gather."""
    if name.startswith(GLOO_PREFIX):
        return name[len(GLOO_PREFIX) :]
    stem = re.sub(r"^nccl(Dev)?Kernel_", "", name.split("(")[0])
    camel = stem.split("_")[0] or stem
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def _host_label(e: Event, parent: Any) -> str | None:
    """The training thread's time: "comm" inside a collective's operator at any depth, "op" where
    its innermost event is another operator."""
    if parent == "comm" or str(e.get("name", "")).startswith(HOST_COMM_PREFIXES):
        return "comm"
    return "op" if e.get("cat") == "cpu_op" else None


def comm_time(events: list[Event]) -> CommTime | None:
    """The communication split of a profiled window's trace (gpu basis when it has NCCL kernels,
    else host); None without step spans or without any collective."""
    events = _complete(events)
    step_events = [e for e in events if e.get("name") == STEP_SPAN]
    if not step_events:
        return None
    steps = [interval(e) for e in step_events]
    nccl = [e for e in events if _is_nccl_kernel(e)]
    if nccl:
        gpu_ops = [e for e in events if e.get("cat") in GPU_CATEGORIES]
        compute = [interval(e) for e in gpu_ops if not _is_nccl_kernel(e)]
        window = [_gpu_window(step_events, gpu_ops)]
        return _split("gpu", nccl, [interval(e) for e in nccl], union(compute), window, len(steps))
    main = (step_events[0].get("pid"), step_events[0].get("tid"))  # the training thread
    own = [e for e in events if (e.get("pid"), e.get("tid")) == main]
    others = [
        e
        for e in events
        if (e.get("pid"), e.get("tid")) != main and str(e.get("name", "")).startswith(GLOO_PREFIX)
    ]
    if not others and not any(str(e.get("name", "")).startswith(HOST_COMM_PREFIXES) for e in own):
        return None
    segments = _innermost(own, _host_label)
    in_flight = [interval(e) for e in others] + segments.get("comm", [])
    busy = union(segments.get("op", []))
    return _split("host", others, in_flight, busy, union(steps), len(steps))


def _split(
    basis: str,
    collectives: list[Event],
    in_flight: list[Interval],
    busy: list[Interval],
    window: list[Interval],
    steps: int,
) -> CommTime:
    """Microsecond intervals -> seconds per step and % of the window."""
    in_flight = intersect(union(in_flight), window)
    comm_us = length(in_flight)
    overlapped_us = length(intersect(in_flight, busy))
    exposed_us = comm_us - overlapped_us
    window_us = length(window)
    found: dict[str, list[Interval]] = {}
    for e in collectives:
        found.setdefault(collective_name(str(e["name"])), []).append(interval(e))
    by_collective = {name: length(intersect(union(iv), window)) for name, iv in found.items()}

    def pct(us: float) -> float:
        return 100.0 * us / window_us if window_us > 0 else 0.0

    return CommTime(
        basis=basis,
        comm_s=comm_us / steps / 1e6,
        exposed_s=exposed_us / steps / 1e6,
        overlapped_s=overlapped_us / steps / 1e6,
        comm_pct=pct(comm_us),
        exposed_pct=pct(exposed_us),
        overlapped_pct=pct(overlapped_us),
        by_collective_s={k: v / steps / 1e6 for k, v in sorted(by_collective.items()) if v > 0},
    )
