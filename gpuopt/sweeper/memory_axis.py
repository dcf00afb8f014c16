"""The memory-aware batch axis: which micro-batch sizes fit this device, from two measured peaks.

Peak memory grows about linearly in the micro-batch, so two peaks measured in subprocesses
(`python -m gpuopt.processes.memory_probe`: the sweeper never imports torch) give fixed +
per-sample memory, and with the device's memory (or a cap) the largest micro-batch that fits with
a margin; the axis becomes the powers of two up to it. A prior, not a wall: an OOM trial is
infeasible, so the sampler still learns the boundary. A distributed config is probed as the job
it is (its peak is the largest rank's, against one device's budget): one process's peak is
neither an FSDP2 rank's (a shard) nor a DDP rank's (plus gradient buckets)."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuopt.core import knobs
from gpuopt.sweeper.shared_process import write_config

log = logging.getLogger(__name__)

BATCH_KEY = knobs.MICRO_BATCH.key  # the micro-batch the axis sizes to the memory
# The share of the budget kept free: allocator fragmentation, cudnn workspaces, the loader's
# pinned buffers, and the fit's error between the two measured sizes and the predicted one.
DEFAULT_MARGIN = 0.15
# The probe measures the preset's smallest micro-batch and this many times it (small enough to fit
# wherever a trial could, far enough apart for the slope to stand out of the RSS's page noise).
PROBE_SPREAD = 4
# At most this many batch choices: the largest ones (throughput lives there; the baseline's own
# batch is measured by the baseline whatever the axis holds).
MAX_CHOICES = 8


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory in MiB at micro-batch b: fixed_mb + per_sample_mb * b."""

    fixed_mb: float
    per_sample_mb: float

    def peak_mb(self, batch: int) -> float:
        return self.fixed_mb + self.per_sample_mb * batch


def fit(points: Sequence[tuple[int, float]]) -> MemoryModel | None:
    """Least squares over (micro-batch, peak MiB) points at >= 2 distinct sizes; None when they
    cannot tell a per-sample cost (one size, or the peak did not grow: nothing to extrapolate)."""
    usable = [(float(b), float(mb)) for b, mb in points if b > 0 and mb is not None and mb >= 0]
    if len({b for b, _ in usable}) < 2:
        return None
    n = len(usable)
    mean_b = sum(b for b, _ in usable) / n
    mean_m = sum(m for _, m in usable) / n
    var = sum((b - mean_b) ** 2 for b, _ in usable)
    slope = sum((b - mean_b) * (m - mean_m) for b, m in usable) / var
    if slope <= 0:
        return None
    return MemoryModel(fixed_mb=max(0.0, mean_m - slope * mean_b), per_sample_mb=slope)


def largest_batch(model: MemoryModel, budget_mb: float, margin: float = DEFAULT_MARGIN) -> int:
    """The largest micro-batch whose predicted peak stays within (1 - margin) of the budget; 0
    when not even the fixed part fits."""
    usable = budget_mb * (1.0 - margin) - model.fixed_mb
    if usable <= 0:
        return 0
    return int(usable // model.per_sample_mb)


@dataclass(frozen=True)
class MemoryBudget:
    """How much memory a trial may use, and where the number comes from (for the log)."""

    mb: float
    source: str  # "hydra.sweeper.memory_cap_mb", "device memory", "available RAM"


def memory_budget(
    device_type: str,
    cap_mb: float | None,
    device_memory_mb: float | None,
    available_ram_mb: float | None,
) -> MemoryBudget | None:
    """A configured cap wins; else the accelerator's memory, or on CPU the available RAM. None:
    no number to fit against (the preset's axis stays)."""
    if cap_mb:
        return MemoryBudget(float(cap_mb), "hydra.sweeper.memory_cap_mb")
    if device_type != "cpu" and device_memory_mb:
        return MemoryBudget(float(device_memory_mb), "device memory")
    if device_type == "cpu" and available_ram_mb:
        return MemoryBudget(float(available_ram_mb), "available RAM")
    return None


@dataclass
class BatchAxis:
    """The batch choices built from the memory model, and what changed from the preset's."""

    choices: list[int]
    dropped: list[tuple[int, str]] = field(default_factory=list)  # (choice, reason)
    added: list[int] = field(default_factory=list)
    key: str = BATCH_KEY

    def rewrite(self, params: Mapping[str, str]) -> dict[str, str]:
        """The preset's params with this axis's choice list for its key."""
        return {**params, self.key: "choice(" + ",".join(str(c) for c in self.choices) + ")"}


def powers_of_two(low: int, high: int) -> list[int]:
    """Powers of two in [low, high] (low rounded up to one)."""
    if high < 1 or high < low:
        return []
    start = 1 << max(0, math.ceil(math.log2(max(1, low))))
    return [1 << k for k in range(int(math.log2(start)), int(math.log2(high)) + 1)]


def batch_choices(preset: Sequence[int], max_batch: int, reason: str) -> BatchAxis:
    """Powers of two from the preset's smallest choice up to `max_batch`, the largest MAX_CHOICES
    of them; preset choices above it dropped with `reason`."""
    low = min(preset) if preset else 1
    # Not even the smallest preset choice is predicted to fit: keep it (its OOM teaches the
    # sampler the boundary) rather than search nothing.
    grown = powers_of_two(low, max_batch)[-MAX_CHOICES:] or [low]
    dropped = []
    for choice in preset:
        if choice not in grown:
            why = (
                reason
                if choice > max_batch
                else "not a power of two, or below the largest choices kept"
            )
            dropped.append((choice, why))
    return BatchAxis(grown, dropped, [c for c in grown if c not in preset])


def preset_batches(params: Mapping[str, str], key: str = BATCH_KEY) -> list[int] | None:
    """The preset's integer batch choices for `key`, or None (not a plain choice of integers)."""
    from hydra.core.override_parser.types import ChoiceSweep, Transformer

    from gpuopt.sweeper.space import parse_entry

    text = params.get(key)
    if text is None:
        return None
    override = parse_entry(key, str(text), "hydra.sweeper.params")
    value = override.value()
    if not (override.is_choice_sweep() and isinstance(value, ChoiceSweep)) or value.tags:
        return None
    choices = list(override.sweep_iterator(transformer=Transformer.identity))
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in choices):
        return None
    return [int(c) for c in choices]


# ---- the probe, in subprocesses (torch stays out of the sweeping process) --------------------


@dataclass
class MemoryProbe:
    """What the memory probe measured: (micro-batch, peak MiB) points; a distributed probe's peak
    is the largest rank's (the budget is per device), every rank's in `rank_peaks`."""

    points: list[tuple[int, float]] = field(default_factory=list)
    device_memory_mb: float | None = None
    available_ram_mb: float | None = None
    error: str | None = None
    world_size: int = 1
    rank_peaks: dict[int, list[float]] = field(default_factory=dict)  # micro-batch -> per rank

    def add(self, batch: int, data: Mapping[str, Any]) -> None:
        """One probe process's JSON line (`read_probe_line`, no error in it) as a point."""
        self.points.append((batch, float(data["peak_mb"])))
        self.device_memory_mb = data.get("device_memory_mb")
        self.available_ram_mb = data.get("available_ram_mb")
        self.world_size = int(data.get("world_size") or 1)
        peaks = data.get("rank_peaks_mb")
        if isinstance(peaks, list) and peaks:
            self.rank_peaks[batch] = [float(mb) for mb in peaks]


def read_probe_line(stdout: str) -> dict[str, Any]:
    """The probe's answer: the last line of its stdout, a JSON object ({} when it printed none);
    raises json.JSONDecodeError for anything else."""
    lines = stdout.strip().splitlines()
    data = json.loads(lines[-1]) if lines else {}
    if not isinstance(data, dict):
        raise json.JSONDecodeError("not a JSON object", lines[-1], 0)
    return data


def probe_failure(returncode: int, data: Mapping[str, Any], stderr: str | None) -> str | None:
    """Why a probe process's answer is no point (its error, a missing peak, a failed exit), or
    None; a distributed probe's says the job's size."""
    if returncode == 0 and not data.get("error") and data.get("peak_mb") is not None:
        return None
    tail = (stderr or "").strip().splitlines()[-1:] or ["no output"]
    why = data.get("error") or tail[0]
    world = data.get("world_size")
    ranks = f" ({world} ranks)" if isinstance(world, int) and world > 1 else ""
    return f"exited {returncode}{ranks}: {why}"


def run_probe(
    config_path: Path,
    batches: Sequence[int],
    timeout_s: float = 120.0,
    python: str | None = None,
) -> MemoryProbe:
    """One fresh process per micro-batch (a CPU's peak RSS cannot be reset); never raises."""
    probe = MemoryProbe()
    for batch in batches:
        cmd = [
            python or sys.executable,
            "-m",
            "gpuopt.processes.memory_probe",
            str(config_path),
            str(batch),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            data = read_probe_line(proc.stdout)
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            probe.error = f"{' '.join(cmd)}: {type(exc).__name__}: {exc}"
            return probe
        failure = probe_failure(proc.returncode, data, proc.stderr)
        if failure is not None:
            probe.error = f"{' '.join(cmd)} {failure}"
            return probe
        probe.add(batch, data)
    return probe


def peak_label(world_size: int = 1) -> str:
    """What the fitted peak is: one process's, or a distributed job's largest rank's."""
    return "peak" if world_size <= 1 else f"peak per rank of {world_size}"


def plan_batch_axis(
    config: Any,
    params: Mapping[str, str],
    arguments: Sequence[str],
    device_type: str,
    options: Any,
    probe_dir: Path,
) -> BatchAxis | None:
    """The batch axis for this sweep (`options`: SweeperOptions' memory_axis, memory_cap_mb,
    env_timeout_s), or None (the preset's stays); not on CPU without a cap (RAM is rarely the
    limit there, and the probe costs two process starts)."""
    preset = preset_batches(params)
    if not options.memory_axis or preset is None:
        return None
    if any(str(a).split("=", 1)[0].lstrip("+~") == BATCH_KEY for a in arguments):
        return None
    if device_type == "cpu" and not options.memory_cap_mb:
        return None
    low = min(preset)
    probe = run_probe(
        write_config(config, probe_dir, "memory_probe.yaml"),
        (low, PROBE_SPREAD * low),
        float(options.env_timeout_s),
    )
    if probe.error:
        log.warning("memory-aware batch axis off (the preset's stays): %s", probe.error)
        return None
    model = fit(probe.points)
    budget = memory_budget(
        device_type, options.memory_cap_mb, probe.device_memory_mb, probe.available_ram_mb
    )
    if model is None or budget is None:
        log.info(
            "memory-aware batch axis off: %ss %s do not grow with the batch, or no budget",
            peak_label(probe.world_size),
            probe.points,
        )
        return None
    most = largest_batch(model, budget.mb)
    reason = (
        f"predicted {peak_label(probe.world_size)} {model.peak_mb(most + 1):.0f}+ MiB above "
        f"{100 * (1 - DEFAULT_MARGIN):.0f}% of {budget.mb:.0f} MiB ({budget.source}); "
        f"largest that fits ~ {most}"
    )
    axis = batch_choices(preset, most, reason)
    log.info(  # as drop_poor_choices' lines; a distributed job's peak and micro-batch are per rank
        "memory-aware: %s ~ %.0f MiB + %.3f MiB/sample; budget %.0f MiB (%s), margin %.0f%%: "
        "largest micro-batch that fits ~ %d",
        peak_label(probe.world_size),
        model.fixed_mb,
        model.per_sample_mb,
        budget.mb,
        budget.source,
        100 * DEFAULT_MARGIN,
        most,
    )
    for choice, why in axis.dropped:
        log.info("memory-aware: dropped %s=%s from the search (%s)", BATCH_KEY, choice, why)
    if axis.added:
        log.info("memory-aware: added %s=%s (predicted to fit)", BATCH_KEY, axis.added)
    return axis
