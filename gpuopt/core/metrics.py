"""THE metric catalogue: every metric a trial reports, once, with all that gpuopt does with it.

Each typed field of `Metrics` is one metric, its record (`Metric`) in the field's metadata; every
other table of metric names derives from these records, and so does docs/measuring.md's
(`docs_table`, `python -m gpuopt.core.metrics`). On the fields rather than in a table beside them:
`gpuopt.Metrics` keeps explicit, statically typed fields, and no second list of names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import Any, Literal

Goal = Literal["maximize", "minimize"]
MAX: Goal = "maximize"
MIN: Goal = "minimize"
# How a distributed job's ranks merge a metric into the job's (gpuopt.trial.ranks):
# rank 0      rank 0's value (a setting or a count every rank shares);
# global      every rank's samples over the slowest rank's window (a rate of the whole job);
# per device  the job's rate over the world size's devices (MFU and its kin);
# slowest     the straggler's (the rank of the longest median step: a step is as slow as it);
# largest     the largest rank's (one starving rank stalls every collective);
# mean, sum   every rank's mean or sum, none unless every rank has one;
# job         computed for the job from its ranks (the spreads, the straggler, energy);
# dropped     none: it describes one rank's share, not the job.
Merge = Literal[
    "rank 0", "global", "per device", "slowest", "largest", "mean", "sum", "job", "dropped"
]
# What a window in a shared measuring process (the race's screen, the in-process confirmation)
# does with a metric: "reads" it from its own steps, or "uses" the whole trial's value.
WindowUse = Literal["reads", "uses"]


@dataclass(frozen=True)
class Row:
    """A metric's row in the single-run table (`python -m gpuopt.run`)."""

    at: int  # its place, top to bottom
    label: str
    digits: int = 1
    note: str = ""
    unit: str | None = None  # None: the metric's; "" where the label names it
    optional: bool = False  # a row only where it was measured, no "-"


@dataclass(frozen=True)
class Column:
    """A metric's column in a table of trials: the report's (`column`) or the page's (`page`)."""

    at: int  # its place, left to right
    header: str
    digits: int = 1  # the page's cells
    width: int = 0  # the page's: % of the table


@dataclass(frozen=True)
class Metric:
    """One metric's record. `goal` None: never an objective (a count, a setting, a spread)."""

    unit: str  # as written after a value: "samples/s", "%", "ms"; "" a count, a word, a ratio
    meaning: str  # the docs' sentence (docs/measuring.md)
    goal: Goal | None = None  # which way is better: Optuna's direction when it is an objective
    ranks: Merge = "rank 0"
    rank_row: bool = False  # in each rank's own row of a distributed result (TrialResult.ranks)
    window: WindowUse | None = None
    screen: str = ""  # the window reading the race's screen ranks it by ("": its own)
    run: Row | None = None  # the single-run table
    compared: int | None = None  # the report's baseline vs best, and --compare: its place
    column: Column | None = None  # the report's trials table, beside the objectives
    page: Column | None = None  # the report page's trials table
    gpm: str = ""  # read from NVML GPM's NVML_GPM_METRIC_<gpm> over the window (Hopper and newer)
    # (a default objective, an env probe fact): as a default objective it stands in for that one
    # on a device where `python -m gpuopt.env --json` says the fact is true
    instead_of: tuple[str, str] | None = None
    name: str = ""  # its field's name, filled in by the catalogue


def record(unit: str, **facts: Any) -> Any:
    """A `Metrics` field (None: "not measurable here", never zero) carrying its record."""
    return field(default=None, metadata={"metric": Metric(unit, **facts)})


# fmt: off
@dataclass
class Metrics:
    """Measured numbers. `None` means "not measurable here", never zero."""

    throughput: float | None = record("samples/s", goal=MAX, ranks="global", rank_row=True,
        window="reads", run=Row(1, "throughput"), compared=1, page=Column(1, "throughput", 0, 10),
        meaning="samples / wall time of the timed window (warm-up and compile excluded)")
    throughput_amortized: float | None = record("samples/s", goal=MAX, ranks="global",
        window="reads", screen="throughput", run=Row(3, "throughput (amortized)", optional=True),
        meaning="`throughput` of a long run: each epoch boundary's cost (`epoch_overhead_s`) "
        "amortized over the real epoch (`epoch_steps`); see "
        "[Steady state](limits.md#steady-state-and-the-epoch-boundary)")
    epoch_overhead_s: float | None = record("s", window="uses", meaning="what one epoch boundary "
        "costs beyond the steady state (measured after the window)")
    epoch_steps: int | None = record("steps", window="uses", meaning="the epoch length it is "
        "amortized over (`data.epoch_steps`, else dataset length / batch)")
    step_time_ms: float | None = record("ms", goal=MIN, ranks="slowest", rank_row=True,
        window="reads", run=Row(4, "step time (median)", 3), compared=2,
        page=Column(2, "step ms", 2, 8), meaning="median step time")
    step_time_p10_ms: float | None = record("ms", ranks="slowest",
        meaning="the window's 10th percentile step time")
    step_time_p90_ms: float | None = record("ms", ranks="slowest",
        meaning="the window's 90th percentile step time")
    step_time_cv: float | None = record("", ranks="slowest",
        meaning="std / mean of the timed window's step times")
    throughput_ci: float | None = record("fraction", ranks="largest",
        meaning="relative half-width of `throughput`'s 95% confidence interval over the steps of "
        "this one timed window: not how far apart another process reads (`run_spread`)")
    run_spread: float | None = record("fraction", run=Row(2, "run to run"), meaning="how far "
        "apart fresh processes of this workload read on this machine: the coefficient of "
        "variation of their `throughput`, as `scripts/bench_noise.py` measured and stored it "
        "(per hardware and workload, in gpuopt's cache folder); null: not measured here")
    run_spread_runs: int | None = record("processes",
        meaning="how many fresh processes `run_spread` was measured over")
    intervals: str | None = record("", meaning="what the intervals cover, in words: "
        "`throughput_ci` over this window's steps, and the run-to-run spread or that it is not "
        "known for this machine and workload")
    cpu_steal_pct: float | None = record("%", run=Row(25, "CPU steal", optional=True,
        note="CPU time the hypervisor gave other guests"), meaning="share of the machine's CPU "
        "time the hypervisor gave other guests during the window (`/proc/stat` steal; Linux VMs)")
    data_wait: float | None = record("%", goal=MIN, ranks="largest", rank_row=True, window="uses",
        run=Row(5, "data wait", note="CUDA: GPU idle for input; CPU: host wait"), compared=5,
        column=Column(2, "wait"), page=Column(3, "data wait %", 1, 8), meaning="share of the "
        "timed window the device starved of input (CUDA: on the GPU timeline; CPU/MPS: the host's "
        "time in `next(loader)`); the input-bound diagnosis reads it")
    host_data_wait: float | None = record("%", goal=MIN, ranks="largest", rank_row=True,
        run=Row(6, "host data wait", note="host time in next(loader)"), meaning="share of the "
        "timed window the host spent in `next(loader)` (the loader's time, overlapped with GPU "
        "work or not); equals `data_wait` on CPU")
    utilization: float | None = record("%", goal=MAX, ranks="job", run=Row(7, "utilization",
        note="NVML on NVIDIA; CPU: 100 - data wait"), compared=3, column=Column(1, "util"),
        page=Column(4, "util %", 1, 5),
        meaning="NVIDIA: NVML `utilization.gpu` during the timed window (\"a kernel was "
        "running\", not \"useful math\"); CPU: 100 - `data_wait`")
    sm_active: float | None = record("%", goal=MAX, ranks="mean", rank_row=True, gpm="SM_UTIL",
        instead_of=("utilization", "gpm"),
        run=Row(8, "SM activity", note="GPM: the share of SMs busy", optional=True), compared=4,
        page=Column(5, "SM active %", 1, 5), meaning="NVIDIA Hopper and newer: the share of the "
        "SMs busy over the timed window (NVML GPM `NVML_GPM_METRIC_SM_UTIL`, DCGM's "
        "`PROF_SM_ACTIVE`): work, where `utilization` says only that a kernel was running; "
        "null where GPM is not there (older GPUs, MIG without GPM, no permission, CPU), the "
        "trial's warnings say why ([two utilizations](#two-utilizations))")
    sm_occupancy: float | None = record("%", goal=MAX, ranks="mean", rank_row=True,
        gpm="SM_OCCUPANCY", run=Row(9, "SM occupancy", note="GPM: warps resident / maximum",
        optional=True), meaning="the warps resident on the SMs against the most they hold, over "
        "the window (`NVML_GPM_METRIC_SM_OCCUPANCY`, DCGM's `PROF_SM_OCCUPANCY`); null as "
        "`sm_active`")
    tensor_active: float | None = record("%", goal=MAX, ranks="mean", rank_row=True,
        gpm="ANY_TENSOR_UTIL", run=Row(10, "tensor-core activity", note="GPM: tensor pipes busy",
        optional=True), meaning="the share of the window the SMs' tensor pipes were busy "
        "(`NVML_GPM_METRIC_ANY_TENSOR_UTIL`, DCGM's `PROF_PIPE_TENSOR_ACTIVE`); null as "
        "`sm_active`")
    dram_bw_util: float | None = record("%", ranks="mean", rank_row=True, gpm="DRAM_BW_UTIL",
        run=Row(11, "DRAM bandwidth", note="GPM: of the theoretical maximum", optional=True),
        meaning="DRAM bandwidth used against the theoretical maximum over the window "
        "(`NVML_GPM_METRIC_DRAM_BW_UTIL`, DCGM's `PROF_DRAM_ACTIVE`); null as `sm_active`")
    peak_memory_mb: float | None = record("MB", goal=MIN, ranks="largest", rank_row=True,
        run=Row(18, "peak memory"), compared=9, meaning="CUDA: `max_memory_allocated` over the "
        "timed window; CPU: growth of the main process's peak RSS over its RSS before the build "
        "(null, with a note, where an earlier configuration in the same process set the peak "
        "higher)")
    peak_reserved_mb: float | None = record("MB", goal=MIN, meaning="CUDA: `max_memory_reserved` "
        "over the timed window (allocated + cached: what the device must hold; shows "
        "fragmentation and `expandable_segments`); null elsewhere")
    mfu: float | None = record("%", goal=MAX, ranks="per device", run=Row(15, "MFU", 2,
        note="of the device's dense peak for the dtype"), compared=6, column=Column(3, "mfu"),
        meaning="model FLOPs x steps/s / the device's documented dense peak for the dtype the "
        "step runs in; null where the peak is unknown (CPUs)")
    hfu: float | None = record("%", goal=MAX, ranks="per device", meaning="the same with hardware "
        "FLOPs (an activation-checkpointed forward recomputed in the backward included)")
    mfu_achievable: float | None = record("%", goal=MAX, ranks="per device",
        run=Row(16, "MFU (achievable)", 2, note="of the measured matmul peak", optional=True),
        meaning="model FLOP/s against this machine's measured matmul peak for the dtype "
        "(`peak_flops_measured`): also on CPUs")
    flops_per_sample: float | None = record("FLOP", run=Row(17, "FLOPs / sample", 0, unit="",
        note="forward + backward"), meaning="model FLOPs per sample (forward + backward, no "
        "recompute), counted once outside the timed window")
    hardware_flops_per_sample: float | None = record("FLOP", meaning="what the device ran per "
        "sample, an activation-checkpoint recompute included (equal to `flops_per_sample` "
        "without checkpointing)")
    peak_flops_measured: float | None = record("FLOP/s", meaning="the matmul probe's peak for the "
        "dtype (cached per machine; `python -m gpuopt.env` shows it)")
    ceiling_throughput: float | None = record("samples/s", goal=MAX, ranks="dropped",
        run=Row(12, "compute ceiling", note="one on-device batch, no loader"), compared=8,
        meaning="the same step replayed on one batch already on the device: the compute-only "
        "limit")
    input_efficiency: float | None = record("%", goal=MAX, ranks="dropped", compared=7,
        run=Row(13, "input efficiency", note="throughput / ceiling"), column=Column(4, "in_eff"),
        meaning="`throughput` / `ceiling_throughput`: what the input pipeline costs")
    loader_cost_us: float | None = record("core-µs",
        meaning="per sample: the input pipeline (a worker-like loop, CPU clock)")
    compute_cost_us: float | None = record("core-µs",
        meaning="per sample: the compute (CPU time of the ceiling replay; CPU only)")
    limit_throughput: float | None = record("samples/s", ranks="dropped",
        run=Row(14, "machine limit", optional=True), meaning="the most this machine can do for "
        "this workload; see [How far from the limit](limits.md#how-far-from-the-limit)")
    limit_bound: str | None = record("", ranks="dropped",
        meaning="what bounds it: `cores` (CPU), `loader` or `compute`")
    limit_efficiency: float | None = record("%", goal=MAX, ranks="dropped",
        meaning="`throughput` / `limit_throughput`")
    compile_time_s: float | None = record("s", goal=MIN, run=Row(21, "compile time", 2,
        note="first step through torch.compile"), meaning="first step through `torch.compile`")
    warmup_time_s: float | None = record("s", run=Row(22, "warm-up time", 2),
        meaning="the warm-up steps")
    startup_time_s: float | None = record("s", ranks="largest", run=Row(23, "startup time", 2,
        note="process start -> first timed step"), meaning="process start to the first timed "
        "step (imports, build, compile, warm-up)")
    power_w: float | None = record("W", goal=MIN, ranks="sum", run=Row(19, "power"),
        meaning="NVML power (total-energy counter / window seconds where supported); null "
        "without NVML")
    energy_per_sample_j: float | None = record("J", goal=MIN, ranks="job", compared=10,
        run=Row(20, "energy / sample", 4), meaning="`power_w` / `throughput`; null without NVML")
    utilization_source: str | None = record("", meaning="how NVML's utilization was obtained: "
        "`device samples` or `polled`; null without NVML")
    power_source: str | None = record("", meaning="how NVML's power was obtained: "
        "`energy counter` or `polled mean`; null without NVML")
    timed_steps: int | None = record("steps", rank_row=True, run=Row(24, "timed window"),
        meaning="the timed window's optimizer steps")
    timed_seconds: float | None = record("s", ranks="largest", rank_row=True,
        meaning="the timed window's seconds")
    stop_reason: str | None = record("",
        meaning="why the window stopped: `stable`, `budget`, `max_steps`")
    compute_dtype: str | None = record("", meaning="the dtype the step computes in (`fp32`, "
        "`tf32`, `bf16`, `fp16`: gpuopt's `precision`, a Trainer's or HF arguments' precision, "
        "`measure_step(precision=...)`); a trial whose dtype is not the baseline's is [the same "
        "training](same-training.md) only where the numerics guard checked it")
    global_batch: int | None = record("samples", meaning="samples per optimizer step (one timed "
        "step = one optimizer step); null where the task did not report it: then no trial is "
        "[the same training](same-training.md)")
    micro_batch: int | None = record("samples",
        meaning="samples per forward/backward (`loader.batch_size`)")
    accumulation_steps: int | None = record("", meaning="micro-batches per optimizer step")
    lr_scale: float | None = record("",
        meaning="the factor `optimizer.lr_scaling` applied to `optimizer.lr`")
    world_size: int | None = record("", ranks="job", run=Row(26, "ranks", optional=True),
        meaning="a distributed trial's ranks ([distributed.md](distributed.md)); null for one "
        "process")
    straggler_rank: int | None = record("", ranks="job",
        meaning="a distributed trial's slowest rank by median step")
    step_time_spread: float | None = record("%", ranks="job",
        meaning="(slowest - fastest rank's median step) / fastest")
    peak_memory_spread_mb: float | None = record("MB", ranks="job",
        meaning="largest - smallest rank's peak memory")
    comm_share: float | None = record("%", ranks="mean", rank_row=True,
        run=Row(27, "communication", optional=True), meaning="with `profile=on`: the share of "
        "the profiled step a collective was in flight (the ranks' mean)")
    comm_exposed: float | None = record("%", ranks="mean", rank_row=True, meaning="the part of "
        "`comm_share` the training thread waited (on CUDA: no other kernel ran)")
    comm_overlapped: float | None = record("%", ranks="mean", rank_row=True,
        meaning="the part of `comm_share` it computed beside")
    lr: float | None = record("",
        meaning="the learning rate it trained with (the optimizer's, scaling applied)")
    loss_drift: float | None = record("", meaning="the numerics guard's largest relative loss "
        "deviation from the fp32 reference over `guard.steps` optimizer steps; null when the "
        "guard did not run ([the numerics guard](same-training.md#the-numerics-guard))")
# fmt: on


METRICS: tuple[Metric, ...] = tuple(
    dataclasses.replace(f.metadata["metric"], name=f.name) for f in dataclasses.fields(Metrics)
)
_BY_NAME = {m.name: m for m in METRICS}


def metric(name: str) -> Metric:
    """The record of the metric `name` (KeyError for a name that is none)."""
    return _BY_NAME[name]


@cache
def goals() -> Mapping[str, Goal]:
    """The metrics that may be objectives, with which way is better (Optuna's direction)."""
    return MappingProxyType({m.name: m.goal for m in METRICS if m.goal is not None})


def higher_is_better(name: str) -> bool:
    """Whether a larger value of the metric `name` is better (where not, a ratio is inverted)."""
    return _BY_NAME[name].goal != MIN


def unit(name: str) -> str:
    """What follows a value of `name` ("samples/s", "%", ...); "" for none, or not a metric."""
    return _BY_NAME[name].unit if name in _BY_NAME else ""


def names(**facts: Any) -> tuple[str, ...]:
    """The metrics whose records hold every given fact, in catalogue order:
    `names(rank_row=True)`, `names(ranks="mean")`, `names(window="uses")`."""
    return tuple(m.name for m in METRICS if all(getattr(m, k) == v for k, v in facts.items()))


def on_device(name: str, facts: Mapping[str, Any]) -> str:
    """The metric a default objective `name` is on a device with these env probe facts: the one
    that stands in for it where its fact is true (`sm_active` for `utilization`), else `name`."""
    for m in METRICS:
        if m.instead_of and m.instead_of[0] == name and facts.get(m.instead_of[1]) is True:
            return m.name
    return name


def window_metrics() -> frozenset[str]:
    """What a window in a shared measuring process reads from its own steps."""
    return frozenset(names(window="reads"))


def _placed(place: str) -> list[Metric]:
    def at(m: Metric) -> int:
        where = getattr(m, place)
        return where if isinstance(where, int) else where.at

    return sorted((m for m in METRICS if getattr(m, place) is not None), key=at)


def run_rows() -> list[tuple[Metric, Row]]:
    """The single-run table's metrics with their rows, top to bottom."""
    return [(m, m.run) for m in _placed("run") if m.run is not None]


def compared() -> tuple[str, ...]:
    """The metrics the report compares between two trials (baseline vs best, --compare), in order."""
    return tuple(m.name for m in _placed("compared"))


def columns(place: Literal["column", "page"]) -> list[tuple[str, Column]]:
    """The metrics with a column in the report's table (`column`) or the page's, left to right."""
    return [(m.name, c) for m in _placed(place) if (c := getattr(m, place)) is not None]


def docs_table() -> str:
    """docs/measuring.md's table of metrics (one row each, in `Metrics`'s order)."""
    rows = [("`status`", "", "", "`ok`, `oom`, `diverged` or `error` (with `reason`)")]
    rows += [(f"`{m.name}`", m.unit, m.goal or "", m.meaning) for m in METRICS]
    lines = ["| name | unit | goal | meaning |", "|---|---|---|---|"]
    lines += ["|" + "|".join(f" {c} " if c else " " for c in row) + "|" for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(docs_table(), end="")
