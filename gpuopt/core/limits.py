"""The machine's limit for one workload, from two measured per-sample costs (pure functions).

On CPU the loader and the compute share the usable cores: limit = cores / (loader cost + compute
cost), in core-seconds per sample. On an accelerator the device computes while the host loads:
limit = min(compute ceiling, loading cores / loader cost), one core kept to drive the device.
Both costs are the measured configuration's, so the limit is this machine's at these settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DRIVER_CORES = 1  # kept for driving an accelerator (kernel launches, the step's Python)


@dataclass(frozen=True)
class Limit:
    """The most this machine can do for the workload, and what bounds it (cores, loader, compute)."""

    throughput: float
    bound: str


def per_sample_cost(core_seconds: float, samples: int) -> float | None:
    """Core-seconds per sample, None when nothing was measured."""
    if samples <= 0 or core_seconds <= 0:
        return None
    return core_seconds / samples


def machine_limit(
    device_type: str,
    cores: int,
    loader_cost_s: float | None,
    compute_cost_s: float | None,
    ceiling: float | None,
) -> Limit | None:
    """The limit from the measured costs (`compute_cost_s` on CPU, `ceiling` elsewhere); None when a
    needed cost is missing. An accelerator's is its compute ceiling unless the host cores free to
    load cannot feed it."""
    if device_type == "cpu":
        if loader_cost_s is None or compute_cost_s is None:
            return None
        return Limit(cores / (loader_cost_s + compute_cost_s), "cores")
    if not ceiling:
        return None
    loading = max(1, cores - DRIVER_CORES) / loader_cost_s if loader_cost_s else 0.0
    return Limit(loading, "loader") if 0 < loading < ceiling else Limit(ceiling, "compute")


def at_least_achieved(limit: Limit, throughput: float | None) -> Limit:
    """The limit, never below what the timed window did: its costs come from short spans outside
    the window, and one slowed by the machine (a cnn replay read 318 samples/s after its window's
    368 on the 2-core CPU) would put the trial at 117% of "the most this machine can do"."""
    if throughput and throughput > limit.throughput:
        return Limit(throughput, limit.bound)
    return limit


def limit_efficiency(throughput: float | None, limit: float | None) -> float | None:
    """throughput / limit, in %."""
    if not throughput or not limit:
        return None
    return 100.0 * throughput / limit


# Another trial's limit this far above a trial's own is "a higher limit at other settings": the
# measured costs vary a few % between trials of the same settings.
OWN_LIMIT_SLACK = 1.05


@dataclass(frozen=True)
class HighestLimit:
    """The highest `limit_throughput` a study's feasible trials measured, and which trial: a
    baseline at 100% of its own limit can be far below what other settings allow. A maximum of
    noisy readings: a pointer to settings worth trying, not a share to divide by."""

    throughput: float
    bound: str
    trial: int


def highest_limit(trials: Iterable[tuple[int, Mapping[str, Any]]]) -> HighestLimit | None:
    """From (trial number, user attrs) pairs; only feasible trials with a measured limit count."""
    best: HighestLimit | None = None
    for number, attrs in trials:
        limit = attrs.get("limit_throughput")
        if attrs.get("status") != "ok" or not isinstance(limit, (int, float)) or limit <= 0:
            continue
        if best is None or limit > best.throughput:
            best = HighestLimit(float(limit), str(attrs.get("limit_bound") or ""), number)
    return best


def higher_elsewhere(attrs: Mapping[str, Any], highest: HighestLimit | None) -> bool:
    """Whether the study measured a limit clearly above this trial's own (at other settings)."""
    own = attrs.get("limit_throughput")
    if highest is None or not isinstance(own, (int, float)) or own <= 0:
        return False
    return highest.throughput > own * OWN_LIMIT_SLACK
