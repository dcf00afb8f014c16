"""The machine's limit for one workload: the most samples/s these cores and this device can do,
derived from two measured per-sample costs (pure functions: no torch, the report can import them).

- The input pipeline's cost: core-seconds per sample of what a DataLoader worker does (fetch
  `dataset[i]` for a batch of indices and collate them), timed on the thread's CPU clock in a
  worker-like loop outside the timed window.
- The compute's cost: on CPU, the core-seconds per sample the training step burns (the process's
  CPU time over the compute-ceiling replay, all compute threads included); on an accelerator, the
  compute ceiling itself (samples/s with the batch already on the device).

On CPU the loader and the compute share the usable cores, so at best every core-second goes to one
of them: limit = cores / (loader cost + compute cost). On an accelerator the device computes while
the host loads: limit = min(compute ceiling, loading cores / loader cost), where one core is kept to
drive the device (the main process: kernel launches, the step's Python) and the rest may load.

Both costs are those of the configuration measured (its batch size, precision and thread count):
the limit is this machine's for this workload at these settings, and `limit_efficiency` says how
much of it the configuration's own loader/compute split reached.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Cores kept for driving an accelerator (the training loop's own process) when deriving how many may
# load data.
DRIVER_CORES = 1


@dataclass(frozen=True)
class Limit:
    """The most this machine can do for the workload, and what bounds it:
    "cores" (CPU: loader and compute share them), "loader" or "compute" (accelerator)."""

    throughput: float
    bound: str


def per_sample_cost(core_seconds: float, samples: int) -> float | None:
    """Core-seconds per sample, None when nothing was measured."""
    if samples <= 0 or core_seconds <= 0:
        return None
    return core_seconds / samples


def cpu_limit(cores: int, loader_cost_s: float, compute_cost_s: float) -> Limit:
    """CPU: the loader and the compute share `cores`; each sample costs both."""
    return Limit(cores / (loader_cost_s + compute_cost_s), "cores")


def accelerator_limit(ceiling: float, cores: int, loader_cost_s: float | None) -> Limit:
    """Accelerator: the compute ceiling, unless the host cores free to load cannot feed it."""
    if loader_cost_s is None or loader_cost_s <= 0:
        return Limit(ceiling, "compute")
    loading = max(1, cores - DRIVER_CORES) / loader_cost_s
    return Limit(ceiling, "compute") if ceiling <= loading else Limit(loading, "loader")


def machine_limit(
    device_type: str,
    cores: int,
    loader_cost_s: float | None,
    compute_cost_s: float | None,
    ceiling: float | None,
) -> Limit | None:
    """The limit for a device type from the measured costs; None when a needed cost is missing.
    `compute_cost_s` (core-seconds per sample) is read on CPU, `ceiling` (samples/s) elsewhere."""
    if device_type == "cpu":
        if loader_cost_s is None or compute_cost_s is None:
            return None
        return cpu_limit(cores, loader_cost_s, compute_cost_s)
    if not ceiling:
        return None
    return accelerator_limit(ceiling, cores, loader_cost_s)


def at_least_achieved(limit: Limit, throughput: float | None) -> Limit:
    """The limit, never below what the timed window itself did: the costs behind it are measured
    in short spans outside the window (a 0.3-0.5 s compute replay), and one slowed by the
    machine (a cnn baseline's replay read 318 samples/s after its window's 368 on the 2-core CPU,
    2026-12-03) would put the trial at 117% of "the most this machine can do"."""
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
    """The highest `limit_throughput` a study's feasible trials measured, and which trial: each
    trial's limit is at its own settings (its batch, threads and precision set the costs per
    sample), so a baseline at 100% of its own can be far below what other settings allow. It is a
    maximum over noisy single measurements, so it reads high: a pointer to settings worth trying,
    not a share to divide by."""

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
