"""The profiled window: a few training steps under torch.profiler, after the timed window, turned
into a per-step phase breakdown, the top operators by self time and (on CUDA) the GPU's time split.

Why a separate window: profiling slows every op (the profiler records each one), so its steps are
never timed for throughput. It runs after the timed window, with the workload warm, for a few steps
(`profile.steps`, after `profile.warmup_steps` steps the profiler records and discards: its first
step pays the profiler's own start-up).

Phases. The native engine names which of its callables are which phase (`Annotation`s); for the
window only, each is shadowed on its owner by a wrapper that enters
`torch.profiler.record_function` (spans `gpuopt:*` in the trace), and restored afterwards. The
timed window's step therefore enters no annotation at all: annotating costs nothing when not
profiling. (Under Lightning, its own profiler hook names the phases: gpuopt.engines.lightning.profile.)
Each step is one `gpuopt:step` span; each phase is the self time of its spans (their duration less
the gpuopt spans nested in them, `SPAN_PHASES`):

- data_wait   `gpuopt:next_batch` (blocked in next(loader); the copy inside it is its own phase)
- h2d_copy    `gpuopt:h2d_copy` (host time of the host-to-device copy: on CUDA a synchronous copy
              also waits for queued work)
- forward     `gpuopt:forward` (the model's forward)
- backward    `gpuopt:forward_backward` less forward: the loss, then backward (Lightning:
              `gpuopt:backward`)
- optimizer   `gpuopt:optimizer` (optimizer.step, inside GradScaler.step under fp16; Lightning runs
              training_step and backward inside it, and they are not counted twice)
- other       the rest of the step: zero_grad, loss bookkeeping, Python, the cache policy

so the phases add up to the step by construction; what a test checks is that the step spans add up
to the wall time of the window measured outside the profiler (`window_s`), within
`STEP_COVERAGE_TOLERANCE`. On CUDA these are host times (the host runs ahead of the GPU and blocks
where it syncs); the GPU's view is `GpuTimeSplit`: kernel and memcpy shares of the window, idle
time split into host wait (the next op had not been launched yet when the GPU went idle: the CPU
did not enqueue work fast enough) and kernel wait (it had been launched but had not started:
launch latency, dependencies), and the GPU busy time by the phase that launched it.

HolisticTraceAnalysis computes the same temporal and idle breakdowns, but version 0.5.0 requires
jupyterlab, pytest, pandas, networkx and pydot at run time: too heavy for a trial process, so the
split is computed here from the trace's GPU events (the same definitions, see `gpu_time_split`).

The trace is written as `trace.json.gz` (Chrome trace format: opens in Perfetto, ui.perfetto.dev,
and in chrome://tracing; TensorBoard's profiler plugin reads it once named `*.pt.trace.json.gz`)
into the trial's run directory, its path in the summary.

Sweeper hook: `PROFILE_OVERRIDE` is the override that turns the window on for one trial (the
sweeper adds it to the baseline's and the best's re-measurement).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from gpuopt.core.spec import ProfileConf

# The Hydra override that profiles one trial (the sweeper's hook for baseline and best).
PROFILE_OVERRIDE = "profile=on"
TRACE_FILE = "trace.json.gz"
SPAN_PREFIX = "gpuopt:"
STEP_SPAN = "gpuopt:step"
PHASES = ("data_wait", "h2d_copy", "forward", "backward", "optimizer", "other")
# The spans the engines annotate (`Annotation.span`), the phases are derived from them.
SPANS = ("next_batch", "h2d_copy", "forward_backward", "forward", "backward", "optimizer")
# The step spans must cover the window's wall time (perf_counter, outside the profiler) to this
# share: what is left is the profiler's own per-step bookkeeping (prof.step()).
STEP_COVERAGE_TOLERANCE = 0.10
# GPU event categories in a Kineto trace.
KERNEL_CATEGORIES = ("kernel",)
MEMORY_CATEGORIES = ("gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


# -- annotating the engine's step -----------------------------------------------------------------
@dataclass(frozen=True)
class Annotation:
    """`owner.attribute` (a callable) is the phase span `gpuopt:<span>` while profiling."""

    owner: Any
    attribute: str
    span: str


@contextlib.contextmanager
def annotated(annotations: Sequence[Annotation]) -> Iterator[None]:
    """Shadow each annotated callable with one that runs inside `record_function(gpuopt:<span>)`,
    on the instance, and put the original back afterwards (also after a failure)."""
    from torch.profiler import record_function

    restore: list[tuple[Any, str, bool, Any]] = []

    def wrap(function: Callable[..., Any], name: str) -> Callable[..., Any]:
        def annotated_call(*args: Any, **kwargs: Any) -> Any:
            with record_function(name):
                return function(*args, **kwargs)

        return annotated_call

    try:
        for a in annotations:
            had_own = a.attribute in getattr(a.owner, "__dict__", {})
            original = getattr(a.owner, a.attribute)
            restore.append((a.owner, a.attribute, had_own, original))
            setattr(a.owner, a.attribute, wrap(original, SPAN_PREFIX + a.span))
        yield
    finally:
        for owner, attribute, had_own, original in reversed(restore):
            if had_own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)  # the class's method shows through again


# -- what the window produced ---------------------------------------------------------------------
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
class ProfileSummary:
    """One profiled window: what `TrialResult.profile` holds (as a dict) and the report reads."""

    steps: int
    step_s: float  # mean step time (host spans)
    window_s: float  # wall time of the profiled steps, perf_counter outside the profiler
    phases_s: dict[str, float]  # per step, PHASES order
    phases_pct: dict[str, float]  # % of the step
    top_ops: list[OperatorTime]
    gpu: GpuTimeSplit | None  # CUDA traces only
    trace_path: str | None
    cost_s: float  # what the window cost the trial: steps, trace export, parsing
    device_type: str = "cpu"
    split_by: str = "gpuopt"  # what computed the breakdown

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileSummary:
        gpu = data.get("gpu")
        return cls(
            **{k: v for k, v in data.items() if k not in ("top_ops", "gpu")},
            top_ops=[OperatorTime(**op) for op in data.get("top_ops") or []],
            gpu=GpuTimeSplit(**gpu) if isinstance(gpu, dict) else None,
        )


# -- reading the trace ----------------------------------------------------------------------------
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


# Each span's self time (its duration less the gpuopt spans nested in it) counts for this phase.
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
    """(steps, mean step seconds, seconds per step by phase) from gpuopt's spans in a trace: each
    phase span's self time, and `other` the rest of the step spans."""
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


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _innermost_phase(spans: list[dict[str, Any]], ts: float) -> str:
    """The phase of the innermost gpuopt span holding host time `ts` (launches: "other" when none)."""
    holding = [e for e in spans if e["ts"] <= ts <= e["ts"] + e["dur"] and e["name"] != STEP_SPAN]
    if not holding:
        return "other"
    name = min(holding, key=lambda e: e["dur"])["name"][len(SPAN_PREFIX) :]
    return SPAN_PHASES.get(name, "other")


def _idle_split(
    busy: list[tuple[float, float]],
    starts: dict[float, float | None],
    window: tuple[float, float],
) -> tuple[float, float, float]:
    """(host wait, kernel wait, unattributed) microseconds of the gaps before each busy interval:
    a gap is host wait until the op that ends it was launched, kernel wait after."""
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
    """The GPU's kernel/memcpy/idle shares over the profiled steps, idle split into host wait and
    kernel wait by each op's launch (runtime event of the same correlation id), and busy time by
    the phase whose span launched it. None for a trace without GPU ops (CPU runs)."""
    gpu_ops = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES + MEMORY_CATEGORIES
    ]
    steps = [e for e in _spans(events) if e["name"] == STEP_SPAN]
    if not gpu_ops or not steps:
        return None
    launches = {
        (e.get("args") or {}).get("correlation"): float(e["ts"])
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "ts" in e
    }
    window = (
        min(float(e["ts"]) for e in steps),
        max(
            max(float(e["ts"] + e["dur"]) for e in steps), max(e["ts"] + e["dur"] for e in gpu_ops)
        ),
    )
    span = window[1] - window[0]
    kernels = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu_ops if e["cat"] == "kernel"])
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu_ops])
    # Each busy interval starts with some op: its launch decides the gap before it.
    launch_of_op_at: dict[float, float | None] = {}
    for e in sorted(gpu_ops, key=lambda e: e["ts"]):
        correlation = (e.get("args") or {}).get("correlation")
        launch_of_op_at.setdefault(float(e["ts"]), launches.get(correlation))
    first_launch = {start: launch_of_op_at.get(start) for start, _ in busy}
    host, kernel_wait, unknown = _idle_split(busy, first_launch, window)
    spans = _spans(events)
    by_phase: dict[str, float] = {}
    for e in gpu_ops:
        launched = launches.get((e.get("args") or {}).get("correlation"))
        phase = _innermost_phase(spans, launched) if launched is not None else "other"
        by_phase[phase] = by_phase.get(phase, 0.0) + float(e["dur"])
    busy_total = sum(by_phase.values()) or 1.0

    def pct(us: float) -> float:
        return 100.0 * us / span if span > 0 else 0.0

    return GpuTimeSplit(
        kernel=pct(_length(kernels)),
        memcpy=pct(_length(busy) - _length(kernels)),
        idle=pct(span - _length(busy)),
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
    """The operators with the most self time per step (device time on CUDA), gpuopt's and the
    optimizer's own annotation spans left out (they are phases, not operators)."""
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
        OperatorTime(
            name,
            host_s,
            100.0 * (key / step_s) if step_s else 0.0,
            device_s,
        )
        for key, name, host_s, device_s in rows[:limit]
    ]


# -- the window -----------------------------------------------------------------------------------
def trial_run_dir() -> Path:
    """Hydra's run directory for this trial, else a new temporary directory (the public API)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(tempfile.mkdtemp(prefix="gpuopt-profile-"))


class ProfiledSteps:
    """warmup_steps + steps training steps under torch.profiler, each in a `gpuopt:step` span, the
    trace written to `trace` when the last one ends; `window_s` is the wall time of the recorded
    steps (perf_counter, synchronized at both ends), `averages` the profiler's operator table.

    Driven like `CeilingReplay`: a loop calls `run(step)`; a framework's hooks call `begin()`,
    then `step_started()` / `step_ended()` around each step until `step_ended()` returns True
    (`close()` after a failure)."""

    def __init__(self, device: torch.device, conf: ProfileConf, trace: Path) -> None:
        self.device, self.conf, self.trace = device, conf, trace
        self.total = conf.warmup_steps + conf.steps
        self.index = 0
        self.finished = False
        self.window_s = 0.0
        self.averages: Any = None
        self._profiler: Any = None
        self._span: Any = None
        self._t0 = 0.0

    def begin(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        plan = schedule(wait=0, warmup=self.conf.warmup_steps, active=self.conf.steps, repeat=1)
        self._profiler = profile(activities=activities, schedule=plan, on_trace_ready=self._ready)
        self._profiler.__enter__()

    def _ready(self, prof: Any) -> None:
        prof.export_chrome_trace(str(self.trace))  # gzipped: the name ends in .gz
        self.averages = prof.key_averages()

    def step_started(self) -> None:
        from torch.profiler import record_function

        from gpuopt.trial.measure import synchronize

        if self.index == self.conf.warmup_steps:
            synchronize(self.device)
            self._t0 = time.perf_counter()
        self._span = record_function(STEP_SPAN)
        self._span.__enter__()

    def step_ended(self) -> bool:
        """Close the step's span; True once the last step ended (the trace is then written)."""
        from gpuopt.trial.measure import synchronize

        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)
        self.index += 1
        if self.index == self.total:
            # The last step's queued GPU work belongs to the window: drain it before the profiler
            # stops (a CPU-GPU sync point, outside any step span).
            synchronize(self.device)
            self.window_s = time.perf_counter() - self._t0
        self._profiler.step()
        if self.index < self.total:
            return False
        self.close()
        self.finished = True
        return True

    def close(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)

    def run(self, step: Callable[[], None]) -> None:
        self.begin()
        try:
            while True:
                self.step_started()
                step()
                if self.step_ended():
                    return
        finally:
            self.close()


def summarize(recorded: ProfiledSteps, began: float) -> ProfileSummary:
    """The summary of a finished `ProfiledSteps` (reads its trace back); `began` counts the cost."""
    events = load_trace(recorded.trace)
    steps, step_s, phases_s = phase_breakdown(events)
    cuda = recorded.device.type == "cuda"
    ops = top_operators(recorded.averages or [], steps, step_s, recorded.conf.top_ops, cuda)
    return ProfileSummary(
        steps=steps,
        step_s=step_s,
        window_s=recorded.window_s,
        phases_s=phases_s,
        phases_pct={k: 100.0 * v / step_s if step_s else 0.0 for k, v in phases_s.items()},
        top_ops=ops,
        gpu=gpu_time_split(events) if cuda else None,
        trace_path=str(recorded.trace),
        cost_s=time.perf_counter() - began,
        device_type=recorded.device.type,
    )


def trace_file(run_dir: Path | None) -> Path:
    """Where the trace goes: `run_dir` (the trial's run directory by default)/trace.json.gz."""
    run_dir = run_dir if run_dir is not None else trial_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir / TRACE_FILE


def run_profiled_window(
    step: Callable[[], None],
    annotations: Sequence[Annotation],
    device: torch.device,
    conf: ProfileConf,
    run_dir: Path | None = None,
) -> ProfileSummary:
    """Profile `conf.steps` calls of `step` (one training step) with `annotations` in place; write
    `trace.json.gz` into `run_dir` (the trial's run directory by default); summarize it."""
    began = time.perf_counter()
    recorded = ProfiledSteps(device, conf, trace_file(run_dir))
    with annotated(annotations):
        recorded.run(step)
    return summarize(recorded, began)
