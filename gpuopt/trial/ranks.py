"""A distributed trial's one result, from its ranks' own, as a performance engineer reads a
multi-GPU step (each metric's catalogue record, gpuopt.core.metrics `ranks`, says which applies):
throughput is every rank's samples over the slowest rank's window; step time is the slowest
rank's (`straggler_rank`, `step_time_spread`); data wait the worst rank's (one starving rank
stalls every collective); peak memory the largest rank's; MFU is per device. Each rank's row and
profiled trace are kept.

A failure is the rank that failed first (or died without a result, with its stderr's head and
tail): the ranks that failed after it (a closed connection, a collective timing out) followed it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from gpuopt.core.metrics import names
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.trial.profiled_window import place_trace


@dataclass(frozen=True)
class RankFailure:
    """A rank that ended without a result of its own, as the launcher saw it."""

    how: str  # "exit code 1" | "killed by SIGKILL"
    message: str | None  # its exception's message, when it raised
    stderr: str | None  # the head and tail of its stderr
    at: float  # when it failed (epoch seconds; 0 unknown)


def merge_ranks(
    results: dict[int, TrialResult], crashed: dict[int, RankFailure], backend: str, elapsed_s: float
) -> TrialResult:
    """The trial's one result from its ranks' results (and the ranks that crashed without one)."""
    world = max([*results, *crashed], default=-1) + 1
    failure = _first_failure(results, crashed)
    base = copy.deepcopy(results.get(0) or next(iter(results.values()), TrialResult(Status.ERROR)))
    base.env.pop("failed_at", None)
    base.env.update(world_size=world, backend=backend)
    base.env.pop("rank", None), base.env.pop("local_rank", None)
    row_names = names(rank_row=True)
    base.ranks = [
        {"rank": rank, "status": r.status.value, **{n: getattr(r.metrics, n) for n in row_names}}
        for rank, r in sorted(results.items())
    ]
    base.profile = _profile(base.profile, results)
    # Every rank's notes, each once, in rank order.
    base.warnings = list(dict.fromkeys(w for _, r in sorted(results.items()) for w in r.warnings))
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


def _profile(
    profile: dict[str, Any] | None, results: dict[int, TrialResult]
) -> dict[str, Any] | None:
    """Rank 0's profile summary, with every rank's trace moved into the run directory."""
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


def _global_metrics(m: Metrics, ranks: list[Metrics]) -> None:
    """Rank 0's metrics `m` turned into the job's, as each metric's record says (its `ranks`)."""
    steps = [r.step_time_ms for r in ranks]
    timed = all(s is not None for s in steps)
    straggler = max(range(len(ranks)), key=lambda i: steps[i] or 0.0) if timed else None
    for how in MERGED:
        for name in names(ranks=how):
            values = [getattr(r, name) for r in ranks]
            setattr(m, name, _merged(how, values, straggler, getattr(m, name)))
    walls = [r.timed_seconds or 0.0 for r in ranks]
    samples = sum((r.throughput or 0.0) * (r.timed_seconds or 0.0) for r in ranks)
    if max(walls) > 0:
        m.throughput = samples / max(walls)
    if straggler is not None:  # every rank timed its steps
        fastest, slowest = min(s or 0.0 for s in steps), steps[straggler] or 0.0
        m.straggler_rank = straggler
        m.step_time_spread = 100.0 * (slowest - fastest) / fastest if fastest > 0 else None
    if m.data_wait is not None and m.utilization is not None and ranks[0].power_w is None:
        m.utilization = 100.0 - m.data_wait  # CPU: 100 - data wait, as for one process
    peaks = [r.peak_memory_mb for r in ranks if r.peak_memory_mb is not None]
    m.peak_memory_spread_mb = max(peaks) - min(peaks) if peaks else m.peak_memory_spread_mb
    _scale_rates(m, len(ranks), ranks[0].throughput)


# The merges (gpuopt.core.metrics.Merge) done by name; the others are rank 0's or computed.
MERGED = ("largest", "mean", "sum", "slowest", "dropped")


def _merged(how: str, values: list[Any], straggler: int | None, own: Any) -> Any:
    """The job's value from every rank's; `own` is rank 0's, `straggler` the slowest rank."""
    present = [v for v in values if v is not None]
    if how == "largest":
        return max(present, default=None)
    if how == "slowest":
        return own if straggler is None else values[straggler]
    if how in ("mean", "sum") and present and len(present) == len(values):
        return sum(present) / len(present) if how == "mean" else sum(present)
    return None  # dropped: a single process's limits describe one rank's share, not the job


def _scale_rates(m: Metrics, world: int, rank0_throughput: float | None) -> None:
    """What rank 0 measured per its own throughput, at the job's: MFU/HFU per device (the global
    FLOP/s over the world size's peaks), the amortized throughput, the energy per sample."""
    if rank0_throughput and m.throughput:
        per_device = m.throughput / world / rank0_throughput
        for name in names(ranks="per device"):
            value = getattr(m, name)
            setattr(m, name, None if value is None else value * per_device)
        if m.throughput_amortized is not None:
            m.throughput_amortized *= m.throughput / rank0_throughput
    m.energy_per_sample_j = m.power_w / m.throughput if m.power_w and m.throughput else None
