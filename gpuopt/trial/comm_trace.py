"""The communication share of a distributed trial's profiled step, from one rank's Chrome trace:
how much of the step a collective was in flight, and how much of that the training thread was
blocked on it (exposed) rather than computing beside it (overlapped).

What torch names the collectives (measured on torch 2.13: a 2-rank gloo DDP and FSDP2 on CPU; the
NCCL names from torch's profiler documentation and issues, not measured here):

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

import re
from dataclasses import dataclass, field
from typing import Any

from gpuopt.trial.trace import (
    KERNEL_CATEGORIES,
    MEMORY_CATEGORIES,
    STEP_SPAN,
    Interval,
    interval,
    length,
    union,
)

GLOO_PREFIX = "gloo:"  # ProcessGroupGloo's spans on its worker threads
NCCL_PREFIXES = ("nccl",)  # ncclDevKernel_* / ncclKernel_* GPU kernels (lower-cased)
# The training thread's own communication: enqueueing a collective, or running one itself.
HOST_COMM_PREFIXES = (
    "c10d::",
    "_c10d_functional::",
    "c10d_functional::",
    "record_param_comms",
    GLOO_PREFIX,
    "nccl:",
)
OP_CATEGORY = "cpu_op"


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


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
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


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _is_nccl_kernel(e: dict[str, Any]) -> bool:
    return e.get("cat") in KERNEL_CATEGORIES and str(e.get("name", "")).lower().startswith(
        NCCL_PREFIXES
    )


def collective_name(name: str) -> str:
    """`gloo:all_reduce` -> all_reduce; `ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)` ->
    all_reduce; `ncclKernel_AllGather_RING_LL_Sum_int8_t(...)` -> all_gather."""
    if name.startswith(GLOO_PREFIX):
        return name[len(GLOO_PREFIX) :]
    stem = re.sub(r"^nccl(Dev)?Kernel_", "", name.split("(")[0])
    camel = stem.split("_")[0] or stem
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def _innermost_segments(thread: list[dict[str, Any]]) -> tuple[list[Interval], list[Interval]]:
    """(busy, host comm) of one thread: where its innermost event is an operator, and where it is
    inside a collective's operator at any depth."""
    busy: list[Interval] = []
    comm: list[Interval] = []
    stack: list[tuple[float, str]] = []  # (end, "op" | "comm" | "annotation")
    cursor: float | None = None

    def advance(to: float) -> None:
        nonlocal cursor
        if cursor is not None and to > cursor and stack:
            label = stack[-1][1]
            if label == "op":
                busy.append((cursor, to))
            elif label == "comm":
                comm.append((cursor, to))
        cursor = to if cursor is None else max(cursor, to)

    for e in sorted(thread, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        start, end = interval(e)
        while stack and stack[-1][0] <= start:
            advance(stack[-1][0])
            stack.pop()
        advance(start)
        if stack:
            end = min(end, stack[-1][0])  # a span overlapping its parent's end: clipped
        name = str(e.get("name", ""))
        if (stack and stack[-1][1] == "comm") or name.startswith(HOST_COMM_PREFIXES):
            label = "comm"
        else:
            label = "op" if e.get("cat") == OP_CATEGORY else "annotation"
        stack.append((end, label))
    while stack:
        advance(stack[-1][0])
        stack.pop()
    return union(busy), union(comm)


def comm_time(events: list[dict[str, Any]]) -> CommTime | None:
    """The communication split of a profiled window's trace (gpu basis when it has NCCL kernels,
    else host); None without step spans or without any collective."""
    events = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    steps = [interval(e) for e in events if e.get("name") == STEP_SPAN]
    if not steps:
        return None
    if any(_is_nccl_kernel(e) for e in events):
        return _gpu_split(events, steps)
    return _host_split(events, steps)


def _host_split(events: list[dict[str, Any]], steps: list[Interval]) -> CommTime | None:
    step = next(e for e in events if e.get("name") == STEP_SPAN)
    main = (step.get("pid"), step.get("tid"))  # the training thread
    own = [e for e in events if (e.get("pid"), e.get("tid")) == main]
    others = [
        e
        for e in events
        if (e.get("pid"), e.get("tid")) != main and str(e.get("name", "")).startswith(GLOO_PREFIX)
    ]
    if not others and not any(str(e.get("name", "")).startswith(HOST_COMM_PREFIXES) for e in own):
        return None
    busy, host_comm = _innermost_segments(own)
    in_flight = [interval(e) for e in others] + host_comm
    return _split("host", others, in_flight, busy, union(steps), len(steps))


def _gpu_split(events: list[dict[str, Any]], steps: list[Interval]) -> CommTime:
    nccl = [e for e in events if _is_nccl_kernel(e)]
    compute = [
        interval(e)
        for e in events
        if e.get("cat") in KERNEL_CATEGORIES + MEMORY_CATEGORIES and not _is_nccl_kernel(e)
    ]
    ends = [end for _, end in (*map(interval, nccl), *compute, *steps)]
    window = [(min(start for start, _ in steps), max(ends))]
    in_flight = [interval(e) for e in nccl]
    return _split("gpu", nccl, in_flight, union(compute), window, len(steps))


def _split(
    basis: str,
    collectives: list[dict[str, Any]],
    in_flight: list[Interval],
    busy: list[Interval],
    window: list[Interval],
    steps: int,
) -> CommTime:
    """Microsecond intervals -> seconds per step and % of the window."""
    in_flight = intersect(union(in_flight), window)
    comm_us = length(in_flight)
    exposed_us = length(subtract(in_flight, busy))
    overlapped_us = comm_us - exposed_us
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
