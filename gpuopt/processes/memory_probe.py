"""`python -m gpuopt.processes.memory_probe CONFIG.yaml BATCH`: a training step's peak memory at one
micro-batch, as one JSON line (the sweeper's memory-aware batch axis, gpuopt/sweeper/memory_axis.py).

Run in a fresh process per micro-batch by the sweeper before the study (it never imports torch),
with the composed task config: the trial's own model, data, optimizer and precision are built the
way the native engine builds them (its `repeated_step`, reached through the engine registry; no
worker processes), two training steps run on one batch, and the peak is read as a trial reads it
(gpuopt.trial.memory.MemoryBaseline): CUDA's allocated peak, or on CPU the peak RSS's growth from
before anything was built. It also reports the device's memory and the available RAM, the budget
the batch axis is fitted against.

A distributed config (`distributed=ddp | fsdp2`) is probed as the job it is: its ranks start as a
trial's do (gpuopt.trial.distributed.launch_ranks: the elastic launcher, a free port, the short
timeout, every rank ending with this process), each builds the step with the model wrapped as a
trial's rank wraps it (the native engine's `Ranks.wrap`: DDP's gradient buckets, FSDP2's shards of
the parameters, gradients and optimizer state) and runs the probe's steps at the per-rank
micro-batch (`loader.batch_size`). The budget is per device, so the probe's peak is the LARGEST
rank's (`peak_mb`); every rank's is in `rank_peaks_mb`, the job's size in `world_size`.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from gpuopt.core.result import TrialResult
    from gpuopt.core.spec import TrialSpec

PROBE_STEPS = 2  # the second step has the optimizer state the first one created


def available_ram_mb() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def device_memory_mb(device: torch.device) -> float | None:
    """The accelerator's total memory (MiB); None on CPU (the budget there is RAM or a cap)."""
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(device).total_memory / 2**20


def measure_peak(config_path: str, batch: int) -> dict[str, Any]:
    """Build the trial at `batch` and run PROBE_STEPS steps; its peak memory (MiB). A
    distributed config: its ranks, each at `batch` (`measure_rank_peaks`)."""
    from omegaconf import OmegaConf

    from gpuopt.trial.prepare import prepare_trial

    cfg = OmegaConf.load(config_path)
    cfg.loader.batch_size = batch
    cfg.loader.num_workers = 0
    prepared = prepare_trial(cfg, allocator=False)  # every probe in the environment the sweep gave
    spec, device = prepared.spec, prepared.device
    if spec.distributed.kind != "none":
        return measure_rank_peaks(spec, device, batch)
    out: dict[str, Any] = {"batch": batch, "device": device.type, "world_size": 1}
    out["peak_mb"] = step_peak_mb(spec, device)
    out["device_memory_mb"] = device_memory_mb(device)
    out["available_ram_mb"] = available_ram_mb()
    return out


def step_peak_mb(spec: TrialSpec, device: torch.device) -> float | None:
    """The peak of PROBE_STEPS repeated training steps in this process (in a rank: this rank's),
    counted from before anything was built (a CPU's peak RSS from here)."""
    from gpuopt.engines.registry import engine_entry
    from gpuopt.trial.measure import synchronize
    from gpuopt.trial.memory import MemoryBaseline

    memory = MemoryBaseline.take(device)
    step = engine_entry("native", "repeated_step")(spec, device)  # gpuopt's own loop builds it
    memory.window_starting()
    for _ in range(PROBE_STEPS):
        step()
    synchronize(device)
    return memory.peak_mb()


def measure_rank_peaks(spec: TrialSpec, device: torch.device, batch: int) -> dict[str, Any]:
    """The distributed job's probe: its ranks started as a trial's (launch_ranks), each running
    `probe_rank`; the largest rank's peak, every rank's, or the job's failure as `error`."""
    from gpuopt.processes import memory_probe  # by its name: a rank unpickles probe_rank from it
    from gpuopt.trial.distributed import launch_ranks

    result = launch_ranks(spec, device, memory_probe.probe_rank)
    world = result.metrics.world_size or spec.distributed.world_size
    out: dict[str, Any] = {"batch": batch, "device": device.type, "world_size": world}
    if not result.ok:
        reason = (result.reason or "").strip().splitlines()[:1] or ["no reason"]
        out["error"] = f"{result.status.value} (distributed={spec.distributed.kind}): {reason[0]}"
        return out
    out["peak_mb"] = result.metrics.peak_memory_mb  # the largest rank's (gpuopt.trial.ranks)
    out["rank_peaks_mb"] = [row["peak_memory_mb"] for row in result.ranks or []]
    out["device_memory_mb"] = result.env.get("device_memory_mb")  # rank 0's device
    out["available_ram_mb"] = available_ram_mb()
    return out


def probe_rank(spec: TrialSpec, device: torch.device) -> TrialResult:
    """One rank of a distributed probe, in the process group gpuopt.trial.distributed set up:
    `step_peak_mb` (the native engine wraps the model for this rank), as a result the launcher's
    merge reads (`peak_memory_mb`); a failure (an OOM on one rank) as its status, so the launcher
    ends the other ranks at once."""
    from gpuopt.core.result import Status, TrialResult
    from gpuopt.trial.failures import classify_failure

    try:
        peak = step_peak_mb(spec, device)
    except Exception as exc:
        status, reason = classify_failure(exc)
        return TrialResult(status=status, reason=reason)
    result = TrialResult(status=Status.OK)
    result.metrics.peak_memory_mb = peak
    result.env["device_memory_mb"] = device_memory_mb(device)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m gpuopt.processes.memory_probe CONFIG.yaml BATCH", file=sys.stderr)
        return 2
    try:
        data = measure_peak(args[0], int(args[1]))
    except Exception as exc:  # an OOM at the probe's size is an answer too: the sweeper logs it
        data = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    print(json.dumps(data, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
