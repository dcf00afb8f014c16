"""`python -m gpuopt.processes.memory_probe CONFIG.yaml BATCH`: a training step's peak memory at one
micro-batch, as one JSON line (the sweeper's memory-aware batch axis, gpuopt/sweeper/memory_axis.py).

Run in a fresh process per micro-batch by the sweeper (which never imports torch). The step is the
native engine's `repeated_step` (no worker processes); two steps run on one batch, and the peak is
read as a trial reads it (gpuopt.trial.memory.MemoryBaseline). A distributed config is probed as
the job it is: its ranks start as a trial's do (launch_ranks), each with the model wrapped as a
trial's rank wraps it (DDP's buckets, FSDP2's shards); the budget is per device, so `peak_mb` is
the LARGEST rank's, every rank's in `rank_peaks_mb`.
"""

from __future__ import annotations

import contextlib
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
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return None


def device_memory_mb(device: torch.device) -> float | None:
    """The accelerator's total memory (MiB); None on CPU (the budget there is RAM or a cap)."""
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(device).total_memory / 2**20


def measure_peak(config_path: str, batch: int) -> dict[str, Any]:
    """Build the trial at `batch` and run PROBE_STEPS steps (a distributed config: in each of its
    ranks); the peak memory (MiB), or the distributed job's failure as `error`."""
    from omegaconf import OmegaConf

    from gpuopt.trial.prepare import prepare_trial

    cfg = OmegaConf.load(config_path)
    cfg.loader.batch_size = batch
    cfg.loader.num_workers = 0
    prepared = prepare_trial(cfg, allocator=False)  # every probe in the environment the sweep gave
    spec, device = prepared.spec, prepared.device
    out: dict[str, Any] = {"batch": batch, "device": device.type}
    if spec.distributed.kind == "none":
        out["world_size"] = 1
        out["peak_mb"] = step_peak_mb(spec, device)
        out["device_memory_mb"] = device_memory_mb(device)
    else:
        from gpuopt.processes import memory_probe  # by name: a rank unpickles probe_rank from it
        from gpuopt.trial.distributed import launch_ranks

        result = launch_ranks(spec, device, memory_probe.probe_rank)
        out["world_size"] = result.metrics.world_size or spec.distributed.world_size
        if not result.ok:
            reason = (result.reason or "").strip().splitlines()[:1] or ["no reason"]
            out["error"] = (
                f"{result.status.value} (distributed={spec.distributed.kind}): {reason[0]}"
            )
            return out
        out["peak_mb"] = result.metrics.peak_memory_mb  # the largest rank's (gpuopt.trial.ranks)
        out["rank_peaks_mb"] = [row["peak_memory_mb"] for row in result.ranks or []]
        out["device_memory_mb"] = result.env.get("device_memory_mb")  # rank 0's device
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


def probe_rank(spec: TrialSpec, device: torch.device) -> TrialResult:
    """One rank of a distributed probe: its peak as `peak_memory_mb` for the launcher's merge; a
    failure (an OOM on one rank) as its status, so the launcher ends the other ranks at once."""
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


def main() -> int:
    args = sys.argv[1:]
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
