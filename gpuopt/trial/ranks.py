"""A distributed trial's one result, from its ranks' own (gpuopt.trial.distributed collects them).

Measured as a performance engineer reads a multi-GPU step: every rank ran the same number of
optimizer steps in a timed window that started at a barrier (gpuopt.engines._distributed), so

- throughput is global: every rank's samples over the slowest rank's window;
- step time is the slowest rank's (a step is as slow as its slowest rank), and the straggler is
  named (`straggler_rank`) with how far the ranks spread (`step_time_spread`);
- data wait is the worst rank's (one starving rank stalls every collective);
- peak memory is the largest rank's, with the spread between ranks (`peak_memory_spread_mb`);
- MFU is per device: the global model FLOP/s over the world size's peaks;
- the communication share of the profiled step (profile=on) is the ranks' mean (each rank's is
  in its row: the straggler waits least, its peers wait for it);
- each rank's own row is kept (`TrialResult.ranks`), and each rank's profiled trace is moved into
  the trial's run directory (trace.json.gz for rank 0, trace_rank{N}.json.gz).

A failure is the trial's status: the rank that failed first (its own OOM, error or divergence),
or one that died without a result (killed, a segfault) with its stderr's head and tail; ranks that
failed after it (a peer's closed connection, a collective timing out) are its consequence.
Torch-free: pure data, but for moving the ranks' traces (gpuopt.trial.profiled_window.place_trace).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.trial.profiled_window import place_trace

# The per-rank row of a distributed result (`TrialResult.ranks`).
RANK_FIELDS = (
    "throughput",
    "step_time_ms",
    "data_wait",
    "host_data_wait",
    "peak_memory_mb",
    "timed_seconds",
    "timed_steps",
    "comm_share",
    "comm_exposed",
    "comm_overlapped",
)
# The ranks' mean for the job (each a % of that rank's profiled step).
MEAN_FIELDS = ("comm_share", "comm_exposed", "comm_overlapped")


@dataclass(frozen=True)
class RankFailure:
    """A rank that ended without a result of its own, as the launcher saw it."""

    how: str  # "exit code 1" | "killed by SIGKILL"
    message: str | None  # its exception's message, when it raised
    stderr: str | None  # the head and tail of its stderr
    at: float  # when it failed (epoch seconds; 0 unknown)


def merge_ranks(
    results: dict[int, TrialResult],
    crashed: dict[int, RankFailure],
    backend: str,
    elapsed_s: float,
) -> TrialResult:
    """The trial's one result from its ranks' results (and the ranks that crashed without one)."""
    world = max([*results, *crashed], default=-1) + 1
    failure = _first_failure(results, crashed)
    base = copy.deepcopy(results.get(0) or next(iter(results.values()), TrialResult(Status.ERROR)))
    base.env.pop("failed_at", None)
    base.env.update(world_size=world, backend=backend)
    base.env.pop("rank", None), base.env.pop("local_rank", None)
    base.ranks = [_rank_row(rank, results[rank]) for rank in sorted(results)]
    base.profile = _profile(base.profile, results)
    base.warnings = _warnings(results)
    base.metrics.world_size = world
    if failure is not None:
        base.status, base.reason = failure
        return base
    if len(results) < world:  # cannot happen without a crash; never report a partial job as ok
        missing = sorted(set(range(world)) - set(results))
        base.status = Status.ERROR
        base.reason = f"ranks {missing} ended without a result after {elapsed_s:.0f} s"
        return base
    _global_metrics(base.metrics, [results[rank].metrics for rank in range(world)])
    return base


def _first_failure(
    results: dict[int, TrialResult], crashed: dict[int, RankFailure]
) -> tuple[Status, str] | None:
    """(status, reason) of the rank that failed first, or None when every rank measured ok."""
    failed = [
        (float(r.env.get("failed_at") or 0.0), rank, r.status, r.reason or "")
        for rank, r in results.items()
        if not r.ok
    ]
    if failed:
        _, rank, status, reason = min(failed)
        if "timed out" in reason.lower():
            reason += (
                " (a collective timed out, distributed.timeout_s: another rank never reached it)"
            )
        return status, f"rank {rank}: {reason}"
    silent = [(f.at, rank, f) for rank, f in crashed.items() if rank not in results]
    if not silent:
        return None
    _, rank, crash = min(silent)
    reason = f"rank {rank} ended without a result ({crash.how})"
    if crash.message:
        reason += f": {crash.message}"
    if crash.stderr:
        reason += f"; its stderr:\n{crash.stderr}"
    return Status.ERROR, reason


def _rank_row(rank: int, result: TrialResult) -> dict[str, object]:
    row: dict[str, object] = {"rank": rank, "status": result.status.value}
    row.update({name: getattr(result.metrics, name) for name in RANK_FIELDS})
    return row


def _profile(
    profile: dict[str, Any] | None, results: dict[int, TrialResult]
) -> dict[str, Any] | None:
    """Rank 0's profile summary, every rank's trace moved into the trial's run directory and
    listed by rank (`rank_traces`)."""
    traces: dict[str, str] = {}
    for rank in sorted(results):
        path = (results[rank].profile or {}).get("trace_path")
        if isinstance(path, str):
            traces[str(rank)] = place_trace(path, rank)
    if profile is None:
        return None
    profile = {**profile, "rank_traces": traces or None}
    profile["trace_path"] = traces.get("0", profile.get("trace_path"))
    return profile


def _warnings(results: dict[int, TrialResult]) -> list[str]:
    """Every rank's notes, each once, in rank order."""
    seen: list[str] = []
    for rank in sorted(results):
        seen += [w for w in results[rank].warnings if w not in seen]
    return seen


def _spread(values: list[float]) -> float | None:
    return 100.0 * (max(values) - min(values)) / min(values) if values and min(values) > 0 else None


def _global_metrics(m: Metrics, ranks: list[Metrics]) -> None:
    """Rank 0's metrics `m` turned into the job's: global throughput over the slowest window, the
    slowest rank's step time, the worst data wait, the largest peak."""
    walls = [r.timed_seconds or 0.0 for r in ranks]
    samples = sum((r.throughput or 0.0) * (r.timed_seconds or 0.0) for r in ranks)
    slowest_window = max(walls)
    rank0_throughput = m.throughput
    if slowest_window > 0:
        m.throughput = samples / slowest_window
        m.timed_seconds = slowest_window
    steps = [r.step_time_ms for r in ranks]
    if all(s is not None for s in steps):
        straggler = max(range(len(ranks)), key=lambda i: steps[i] or 0.0)
        slow = ranks[straggler]
        m.straggler_rank = straggler
        m.step_time_ms, m.step_time_p10_ms = slow.step_time_ms, slow.step_time_p10_ms
        m.step_time_p90_ms, m.step_time_cv = slow.step_time_p90_ms, slow.step_time_cv
        m.step_time_spread = _spread([s for s in steps if s is not None])
    for name in ("data_wait", "host_data_wait", "startup_time_s", "throughput_ci"):
        values = [v for r in ranks if (v := getattr(r, name)) is not None]
        setattr(m, name, max(values) if values else None)
    if m.data_wait is not None and m.utilization is not None and m.power_w is None:
        m.utilization = 100.0 - m.data_wait  # CPU: 100 - data wait, as for one process
    for name in MEAN_FIELDS:
        values = [v for r in ranks if (v := getattr(r, name)) is not None]
        setattr(m, name, sum(values) / len(values) if len(values) == len(ranks) else None)
    peaks = [r.peak_memory_mb for r in ranks if r.peak_memory_mb is not None]
    if peaks:
        m.peak_memory_mb, m.peak_memory_spread_mb = max(peaks), max(peaks) - min(peaks)
    _scale_rates(m, ranks, rank0_throughput)


def _scale_rates(m: Metrics, ranks: list[Metrics], rank0_throughput: float | None) -> None:
    """What rank 0 measured per its own throughput, at the job's: MFU/HFU per device (the global
    FLOP/s over the world size's peaks), the amortized throughput; power over every rank."""
    world = len(ranks)
    if rank0_throughput and m.throughput:
        per_device = m.throughput / world / rank0_throughput
        m.mfu = m.mfu * per_device if m.mfu is not None else None
        m.hfu = m.hfu * per_device if m.hfu is not None else None
        m.mfu_achievable = m.mfu_achievable * per_device if m.mfu_achievable is not None else None
        ratio = m.throughput / rank0_throughput
        if m.throughput_amortized is not None:
            m.throughput_amortized *= ratio
    powers = [r.power_w for r in ranks if r.power_w is not None]
    m.power_w = sum(powers) if len(powers) == world else None
    m.energy_per_sample_j = m.power_w / m.throughput if m.power_w and m.throughput else None
    # The single-process limits describe one rank's share, not the job: left out.
    m.limit_throughput = m.limit_efficiency = m.limit_bound = None
    m.ceiling_throughput = m.input_efficiency = None
