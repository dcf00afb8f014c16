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
profiling. (Under Lightning, its own profiler hook names the phases: gpuopt.engines.lightning.fit_profile.)
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
launch latency, dependencies), and the GPU busy time by the phase that launched it. Reading the
trace is `gpuopt.trial.trace`.

The trace is written as `trace.json.gz` (Chrome trace format: opens in Perfetto, ui.perfetto.dev,
and in chrome://tracing; TensorBoard's profiler plugin reads it once named `*.pt.trace.json.gz`)
into the trial's run directory, its path in the summary.

A distributed trial: every rank profiles the same steps (they are collectives), the recorded ones
started together after a barrier (`ProfiledSteps.align`); rank N>0 writes `trace_rank{N}.json.gz`.
The ranks run outside Hydra, so they write into a temporary directory and the trial's process moves
the traces into its run directory (`place_trace`, from gpuopt.trial.ranks). Each rank's summary
adds its communication split (`ProfileSummary.comm`, gpuopt.trial.comm_trace).

Sweeper hook: `profile=on` turns the window on for one trial (gpuopt.sweeper.profile_runs adds it
to the baseline's and the best's re-measurement).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuopt.trial.comm_trace import CommTime, comm_time
from gpuopt.trial.trace import (
    SPAN_PREFIX,
    STEP_SPAN,
    GpuTimeSplit,
    OperatorTime,
    gpu_time_split,
    load_trace,
    phase_breakdown,
    top_operators,
)

if TYPE_CHECKING:
    import torch

    from gpuopt.core.spec import ProfileConf

TRACE_FILE = "trace.json.gz"
RANK_TRACE_FILE = "trace_rank{rank}.json.gz"  # ranks 1.. of a distributed trial
# The step spans must cover the window's wall time (perf_counter, outside the profiler) to this
# share: what is left is the profiler's own per-step bookkeeping (prof.step()).
STEP_COVERAGE_TOLERANCE = 0.10


def steps_within_budget(conf: ProfileConf, step_ms: float | None) -> ProfileConf:
    """`conf` with as many recorded steps as fit in `conf.max_s` of the timed window's steps
    (`step_ms`, its median step), at least one and at most `conf.steps`. Why: a cnn's batch-256
    steps of 0.9 s made the default 1 + 5 profiled steps cost a race's finalist 9 s, three times
    its timed window; one slow step already holds thousands of ops to split into phases."""
    import dataclasses

    if conf.max_s is None or not step_ms or step_ms <= 0:
        return conf
    fitting = max(1, int(conf.max_s * 1000.0 / step_ms))
    return conf if fitting >= conf.steps else dataclasses.replace(conf, steps=fitting)


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
    # A distributed trial's rank: its collectives (gpuopt.trial.comm_trace); None in one process.
    comm: CommTime | None = None
    # A distributed trial's result: every rank's trace by rank (rank 0's is `trace_path`).
    rank_traces: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileSummary:
        gpu, comm = data.get("gpu"), data.get("comm")
        return cls(
            **{k: v for k, v in data.items() if k not in ("top_ops", "gpu", "comm")},
            top_ops=[OperatorTime(**op) for op in data.get("top_ops") or []],
            gpu=GpuTimeSplit(**gpu) if isinstance(gpu, dict) else None,
            comm=CommTime(**comm) if isinstance(comm, dict) else None,
        )


# -- the window -----------------------------------------------------------------------------------
RUN_DIR_ENV = "GPUOPT_RUN_DIR"  # a trial's run directory outside Hydra (the race's whole trials)
TEMP_PREFIX = "gpuopt-profile-"


def known_run_dir() -> Path | None:
    """Hydra's run directory for this trial, else $GPUOPT_RUN_DIR (set by the process that runs
    trials outside Hydra: gpuopt.processes.shared_windows), else None."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        return Path(HydraConfig.get().runtime.output_dir)
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    return None


def trial_run_dir() -> Path:
    """`known_run_dir()`, else a new temporary directory (the public API; a distributed trial's
    ranks, which run outside Hydra: the trial's process moves their traces, `place_trace`)."""
    return known_run_dir() or Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))


class ProfiledSteps:
    """warmup_steps + steps training steps under torch.profiler, each in a `gpuopt:step` span, the
    trace written to `trace` when the last one ends; `window_s` is the wall time of the recorded
    steps (perf_counter, synchronized at both ends), `averages` the profiler's operator table.

    Driven like `CeilingReplay`: a loop calls `run(step)`; a framework's hooks call `begin()`,
    then `step_started()` / `step_ended()` around each step until `step_ended()` returns True
    (`close()` after a failure). `align` (a distributed trial's barrier) runs right before the
    first recorded step, outside any step span: every rank's recorded steps start together."""

    def __init__(
        self,
        device: torch.device,
        conf: ProfileConf,
        trace: Path,
        align: Callable[[], None] | None = None,
    ) -> None:
        self.device, self.conf, self.trace, self.align = device, conf, trace, align
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
            if self.align is not None:
                self.align()
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


def summarize(recorded: ProfiledSteps, began: float, comm: bool = False) -> ProfileSummary:
    """The summary of a finished `ProfiledSteps` (reads its trace back); `began` counts the cost;
    `comm`: a distributed trial's rank, its collectives split too (gpuopt.trial.comm_trace)."""
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
        comm=comm_time(events) if comm else None,
    )


def trace_name(rank: int | None = None) -> str:
    """trace.json.gz (one process, a distributed trial's rank 0), trace_rank{N}.json.gz (rank N)."""
    return RANK_TRACE_FILE.format(rank=rank) if rank else TRACE_FILE


def trace_file(run_dir: Path | None, rank: int | None = None) -> Path:
    """Where the trace goes: `run_dir` (the trial's run directory by default)/`trace_name(rank)`."""
    run_dir = run_dir if run_dir is not None else trial_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir / trace_name(rank)


def place_trace(path: str, rank: int) -> str:
    """A rank's trace in the trial's run directory, its path. The ranks get the run directory
    (gpuopt.trial.distributed sets RUN_DIR_ENV for them) and write there; this moves a trace a
    rank wrote into a temporary directory (it knew no run directory) from the trial's process.
    Where no run directory is known, or the trace is there already, `path` as it was."""
    run_dir, source = known_run_dir(), Path(path)
    if run_dir is None or not source.exists() or source.parent.resolve() == run_dir.resolve():
        return path
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / trace_name(rank)
    shutil.move(str(source), target)
    if source.parent.name.startswith(TEMP_PREFIX):  # the rank's own temporary directory
        with contextlib.suppress(OSError):
            source.parent.rmdir()
    return str(target)


def run_profiled_window(
    step: Callable[[], None],
    annotations: Sequence[Annotation],
    device: torch.device,
    conf: ProfileConf,
    run_dir: Path | None = None,
    rank: int | None = None,
    align: Callable[[], None] | None = None,
) -> ProfileSummary:
    """Profile `conf.steps` calls of `step` (one training step) with `annotations` in place; write
    the trace into `run_dir` (the trial's run directory by default); summarize it. A distributed
    trial's `rank` (every rank runs the same steps, each started after `align`, its barrier) names
    its trace (`trace_name`) and has its collectives split (`ProfileSummary.comm`)."""
    began = time.perf_counter()
    recorded = ProfiledSteps(device, conf, trace_file(run_dir, rank), align)
    with annotated(annotations):
        recorded.run(step)
    return summarize(recorded, began, comm=rank is not None)
