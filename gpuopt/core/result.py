"""What one trial produced: the contract between the trial engine and everything that reads it.

The task function returns a `TrialResult`; the sweeper turns it into Optuna values, constraints and
user attributes; the report reads those attributes back. Metric names here are the public output
contract (README, "Metrics").
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class Status(str, Enum):
    """How a trial ended. Only `error` counts as a failure of the sweep's machinery."""

    OK = "ok"
    OOM = "oom"  # ran out of device (or host) memory: an infeasible configuration
    DIVERGED = "diverged"  # loss became NaN/inf: an infeasible configuration
    ERROR = "error"  # anything else: a bug, a crash, a bad user model


# Which way is better for each metric. The sweeper derives Optuna directions from this table,
# and an objective must be one of these names.
METRIC_GOALS: dict[str, str] = {
    "throughput": "maximize",  # samples/s over the timed window (steady state)
    # samples/s of a long run: the steady state with each epoch boundary's cost amortized over the
    # user's epoch length (data.epoch_steps, or the dataset's length / batch size)
    "throughput_amortized": "maximize",
    "utilization": "maximize",  # % (NVML GPU utilization; on CPU 100 - data_wait)
    "mfu": "maximize",  # % of the device's dense peak FLOP/s for the dtype (model FLOPs)
    "hfu": "maximize",  # the same with hardware FLOPs (activation-checkpoint recompute included)
    "mfu_achievable": "maximize",  # model FLOP/s % of this machine's measured matmul peak
    "limit_efficiency": "maximize",  # throughput / limit_throughput, %
    "input_efficiency": "maximize",  # throughput / ceiling_throughput, %
    "ceiling_throughput": "maximize",  # samples/s with the batch already on the device
    "step_time_ms": "minimize",  # median step time
    "data_wait": "minimize",  # % of timed wall time the device starved of input
    "host_data_wait": "minimize",  # % of timed wall time the host spent in next(loader)
    "peak_memory_mb": "minimize",
    "peak_reserved_mb": "minimize",
    "power_w": "minimize",
    "energy_per_sample_j": "minimize",
    "compile_time_s": "minimize",
}


@dataclass
class Metrics:
    """Measured numbers. `None` means "not measurable here", never zero."""

    throughput: float | None = None
    throughput_amortized: float | None = None  # over the user's epoch (README, "Steady state")
    epoch_overhead_s: float | None = None  # what one epoch boundary costs beyond steady state
    epoch_steps: int | None = None  # the epoch length it is amortized over
    step_time_ms: float | None = None
    step_time_p10_ms: float | None = None
    step_time_p90_ms: float | None = None
    step_time_cv: float | None = None  # std/mean of step times in the timed window
    throughput_ci: float | None = None  # relative half-width of the 95% CI of throughput
    # % of the machine's CPU time the hypervisor gave other guests during the window (Linux)
    cpu_steal_pct: float | None = None
    # % of the window the device starved of input (CUDA: on the GPU timeline; else host wait)
    data_wait: float | None = None
    host_data_wait: float | None = None  # % of the window the host spent in next(loader)
    utilization: float | None = None
    peak_memory_mb: float | None = None
    peak_reserved_mb: float | None = None  # CUDA: the caching allocator's reserved peak
    mfu: float | None = None  # model FLOPs vs the documented dense peak (null where unknown)
    hfu: float | None = None  # hardware FLOPs (recompute included) vs the documented peak
    mfu_achievable: float | None = None  # model FLOPs vs the measured matmul peak
    flops_per_sample: float | None = None  # model FLOPs (forward + backward, no recompute)
    hardware_flops_per_sample: float | None = None  # what the device ran, recompute included
    peak_flops_measured: float | None = None  # the matmul probe's FLOP/s for the dtype
    ceiling_throughput: float | None = None
    input_efficiency: float | None = None
    loader_cost_us: float | None = None  # core-microseconds of input pipeline per sample
    compute_cost_us: float | None = None  # core-microseconds of compute per sample (CPU)
    limit_throughput: float | None = None  # the most this machine can do for the workload
    limit_bound: str | None = None  # what bounds it: cores (CPU) | loader | compute
    limit_efficiency: float | None = None  # throughput / limit_throughput, %
    compile_time_s: float | None = None
    warmup_time_s: float | None = None
    startup_time_s: float | None = None  # process start -> first timed step
    power_w: float | None = None
    energy_per_sample_j: float | None = None
    # How NVML's numbers were obtained (gpuopt.trial.monitor): "device samples" | "polled", and
    # "energy counter" | "polled mean"; None without NVML.
    utilization_source: str | None = None
    power_source: str | None = None
    timed_steps: int | None = None
    timed_seconds: float | None = None
    stop_reason: str | None = None  # stable | budget | max_steps
    # What one optimizer step trains on (one timed step = one optimizer step); None where the task
    # did not report it (then no trial is "the same training": gpuopt.study.rules.unknown_training).
    global_batch: int | None = None  # samples per optimizer step
    micro_batch: int | None = None  # samples per forward/backward (loader.batch_size)
    accumulation_steps: int | None = None  # micro-batches per optimizer step
    lr_scale: float | None = None  # the factor optimizer.lr_scaling applied to optimizer.lr
    # A distributed trial (distributed=ddp | fsdp2, gpuopt.trial.ranks): the ranks it ran on, the
    # slowest one by median step time, how far the ranks' step times and peaks spread.
    world_size: int | None = None
    straggler_rank: int | None = None
    step_time_spread: float | None = None  # (slowest - fastest median step) / fastest, %
    peak_memory_spread_mb: float | None = None  # largest - smallest rank's peak memory
    # Its profiled window (profile=on; gpuopt.trial.comm_trace), % of the step: a collective in
    # flight, and of that the part the training thread waited for (exposed; on CUDA: no other
    # kernel ran) and the part it computed beside (overlapped). The job's: the mean over ranks.
    comm_share: float | None = None
    comm_exposed: float | None = None
    comm_overlapped: float | None = None
    lr: float | None = None  # the learning rate it trained with (the optimizer's, scaling applied)
    # The numerics guard (gpuopt.trial.numerics): the largest relative loss deviation from the fp32
    # reference over guard.steps optimizer steps; None when the guard did not run.
    loss_drift: float | None = None


@dataclass
class TrialResult:
    """One trial: its status, its metrics, and the facts needed to compare it with others."""

    status: Status
    metrics: Metrics = field(default_factory=Metrics)
    reason: str | None = None  # for oom/diverged/error: exception type and message
    config: dict[str, Any] = field(default_factory=dict)  # the resolved trial config
    env: dict[str, Any] = field(default_factory=dict)  # the fingerprint (gpuopt.trial.devices)
    warnings: list[str] = field(default_factory=list)  # settings that could not apply, etc.
    # The profiled window's summary (gpuopt.trial.profiled_window.ProfileSummary.to_dict()), when profiled:
    # phases, top operators, GPU split, trace_path. None when the trial was not profiled.
    profile: dict[str, Any] | None = None
    # The numerics guard's evidence (gpuopt.trial.numerics.GuardEvidence as a dict); None: not run.
    numerics: dict[str, Any] | None = None
    # A distributed trial's ranks, one row each (rank, status, throughput, step_time_ms, data_wait,
    # host_data_wait, peak_memory_mb, timed_seconds); None for a single-process trial.
    ranks: list[dict[str, Any]] | None = None
    # The trial's phase clock (gpuopt.trial.context.Trial.phase): seconds per phase of the whole
    # trial (build, flops, warmup, window, ..., guard, other), summing to its wall time in
    # run_measured. Not a metric (no objective, not in the table); None where nothing was clocked.
    phases: dict[str, float] | None = None
    # Why the extras only an answer needs (profile, compute ceiling, numerics guard) were skipped:
    # its window read below measure.contender_floor (a race's slow finalist). None: not skipped.
    extras_skipped: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def metric(self, name: str) -> float | None:
        if name not in METRIC_GOALS and not hasattr(self.metrics, name):
            raise KeyError(f"unknown metric {name!r}; known: {', '.join(sorted(METRIC_GOALS))}")
        value = getattr(self.metrics, name)
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else value

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        known = {f.name for f in dataclasses.fields(Metrics)}
        metrics = Metrics(**{k: v for k, v in (data.get("metrics") or {}).items() if k in known})
        return cls(
            status=Status(data["status"]),
            metrics=metrics,
            reason=data.get("reason"),
            config=data.get("config") or {},
            env=data.get("env") or {},
            warnings=list(data.get("warnings") or []),
            profile=data.get("profile") if isinstance(data.get("profile"), dict) else None,
            numerics=data.get("numerics"),
            ranks=data.get("ranks") if isinstance(data.get("ranks"), list) else None,
            phases=data.get("phases") if isinstance(data.get("phases"), dict) else None,
            extras_skipped=data.get("extras_skipped"),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TrialResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


# The trial user attrs a result is stored under (`result_user_attrs`), besides every metric flat
# under its own name (e.g. "throughput"). Named here, by their writer; gpuopt.study.keys lists them
# with every other key the sweeper writes, and readers take them from there.
ATTR_STATUS = "status"
ATTR_REASON = "reason"
ATTR_ENV = "env"
ATTR_CONFIG = "config"  # the resolved trial config
ATTR_WARNINGS = "warnings"
ATTR_PROFILE = "profile"  # the profiled window's summary (dict), on profiled trials only
ATTR_NUMERICS = "numerics"  # the numerics guard's evidence (dict), absent when it did not run
ATTR_RANKS = "ranks"  # a distributed trial's per-rank rows (list), absent for one process
ATTR_PHASES = "phases"  # the trial's phase clock (dict: phase -> seconds), absent when not clocked
ATTR_EXTRAS_SKIPPED = "extras_skipped"  # why its profile, ceiling and guard did not run (str)


def result_user_attrs(result: TrialResult) -> dict[str, Any]:
    """The user attributes a trial's result is stored under (all JSON-serializable)."""
    attrs: dict[str, Any] = {k: v for k, v in dataclasses.asdict(result.metrics).items()}
    attrs[ATTR_STATUS] = result.status.value
    attrs[ATTR_REASON] = result.reason
    attrs[ATTR_ENV] = result.env
    attrs[ATTR_CONFIG] = result.config
    attrs[ATTR_WARNINGS] = result.warnings
    if result.profile is not None:
        attrs[ATTR_PROFILE] = result.profile
    if result.numerics is not None:
        attrs[ATTR_NUMERICS] = result.numerics
    if result.ranks is not None:
        attrs[ATTR_RANKS] = result.ranks
    if result.phases is not None:
        attrs[ATTR_PHASES] = result.phases
    if result.extras_skipped is not None:
        attrs[ATTR_EXTRAS_SKIPPED] = result.extras_skipped
    return json.loads(json.dumps(attrs, default=str))
