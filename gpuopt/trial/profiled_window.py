"""The profiled window: a few training steps under torch.profiler, after the timed window (profiling
slows every op, so its steps are never timed for throughput), turned into a per-step phase
breakdown, the top operators and (on CUDA) the GPU's time split (docs/profiles.md).

For the window only, each callable an engine names (`Annotation`) is shadowed by a wrapper in
`record_function` (spans `gpuopt:*`), so the timed window's step enters no annotation at all. Each
step is one `gpuopt:step` span, each phase the self time of its spans (gpuopt.trial.trace
`SPAN_PHASES`), `other` the rest: the phases add up to the step by construction, and the step
spans must cover the window's wall time measured outside the profiler. On CUDA these are host
times; the GPU's view is `GpuTimeSplit`.

A distributed trial's ranks start the recorded steps together after a barrier (`align`); rank
N>0 writes `trace_rank{N}.json.gz`, and its summary adds its communication split (`comm`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuopt.trial.trace import (
    SPAN_PREFIX,
    STEP_SPAN,
    CommTime,
    GpuTimeSplit,
    OperatorTime,
    comm_time,
    gpu_time_split,
    load_trace,
    phase_breakdown,
    top_operators,
)

if TYPE_CHECKING:
    import torch

    from gpuopt.core.spec import ProfileConf

TRACE_FILE = "trace.json.gz"
# The step spans must cover the window's wall time (perf_counter, outside the profiler) to this
# share: what is left is the profiler's own per-step bookkeeping (prof.step()).
STEP_COVERAGE_TOLERANCE = 0.10


def steps_within_budget(conf: ProfileConf, step_ms: float | None) -> ProfileConf:
    """`conf` with as many recorded steps as fit in `conf.max_s` of `step_ms` steps (1 to
    `conf.steps`). Why: a cnn's batch-256 steps of 0.9 s made 1 + 5 profiled steps cost a race's
    finalist 9 s, three times its timed window; one slow step already holds thousands of ops."""
    if conf.max_s is None or not step_ms or step_ms <= 0:
        return conf
    fitting = max(1, int(conf.max_s * 1000.0 / step_ms))
    return conf if fitting >= conf.steps else replace(conf, steps=fitting)


@dataclass(frozen=True)
class Annotation:
    """`owner.attribute` (a callable) is the phase span `gpuopt:<span>` while profiling."""

    owner: Any
    attribute: str
    span: str


@contextlib.contextmanager
def annotated(annotations: Sequence[Annotation]) -> Iterator[None]:
    """Shadow each annotated callable, on the instance, with one inside
    `record_function(gpuopt:<span>)`; put the originals back afterwards."""
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
    # A distributed trial's rank: its collectives (gpuopt.trial.trace.comm_time); None in one process.
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


RUN_DIR_ENV = "GPUOPT_RUN_DIR"  # a trial's run directory outside Hydra (the race's whole trials)
TEMP_PREFIX = "gpuopt-profile-"


def hydra_run_dir() -> Path | None:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        return Path(HydraConfig.get().runtime.output_dir)
    return None


def known_run_dir() -> Path | None:
    """Hydra's run directory for this trial, else $GPUOPT_RUN_DIR (trials outside Hydra), else None."""
    outside = os.environ.get(RUN_DIR_ENV)
    return hydra_run_dir() or (Path(outside) if outside else None)


def trial_run_dir() -> Path:
    """`known_run_dir()`, else a new temporary directory (the trial's process moves a rank's
    trace from there, `place_trace`)."""
    return known_run_dir() or Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))


class ProfiledSteps:
    """warmup_steps + steps training steps under torch.profiler, each in a `gpuopt:step` span, the
    trace written to `trace` after the last; `window_s` is the recorded steps' wall time.

    A loop or a framework's hooks call `begin()`, then `step_started()` / `step_ended()` around
    each step until it returns True (`close()` after a failure). `align`
    (a distributed trial's barrier) runs right before the first recorded step, outside its span."""

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

        self._end_span()
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

    def _end_span(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)

    def close(self) -> None:
        self._end_span()
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)


def summarize(recorded: ProfiledSteps, began: float, comm: bool = False) -> ProfileSummary:
    """The summary of a finished `ProfiledSteps` (`began`: when its cost started; `comm`: a
    distributed trial's rank, its collectives split too)."""
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
    return f"trace_rank{rank}.json.gz" if rank else TRACE_FILE


def trace_file(run_dir: Path | None, rank: int | None = None) -> Path:
    """Where the trace goes: `run_dir` (the trial's run directory by default)/`trace_name(rank)`."""
    run_dir = run_dir if run_dir is not None else trial_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir / trace_name(rank)


def place_trace(path: str, rank: int) -> str:
    """A rank's trace moved into the trial's run directory, its path (`path` as it was where no
    run directory is known or the trace is there already)."""
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
    rank: int | None = None,
    align: Callable[[], None] | None = None,
) -> ProfileSummary:
    """Profile `conf.steps` calls of `step` with `annotations` in place, the trace in the trial's
    run directory, and summarize it. A distributed trial's `rank` names its trace and has its
    collectives split."""
    began = time.perf_counter()
    recorded = ProfiledSteps(device, conf, trace_file(None, rank), align)
    with annotated(annotations):
        recorded.begin()
        try:
            while True:
                recorded.step_started()
                step()
                if recorded.step_ended():
                    break
        finally:
            recorded.close()
    return summarize(recorded, began, comm=rank is not None)
