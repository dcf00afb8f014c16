"""`python -m gpuopt.trial.memory_probe CONFIG.yaml BATCH`: a training step's peak memory at one
micro-batch, as one JSON line (the sweeper's memory-aware batch axis, gpuopt/sweeper/memory_axis.py).

Run in a fresh process per micro-batch by the sweeper before the study (it never imports torch),
with the composed task config: the trial's own model, data, optimizer and precision are built the
way the native engine builds them (its `repeated_step`, reached through the engine registry; no
worker processes), two training steps run on one batch, and the peak is read as a trial reads it
(gpuopt.trial.memory.MemoryBaseline): CUDA's allocated peak, or on CPU the peak RSS's growth from
before anything was built. It also reports the device's memory and the available RAM, the budget
the batch axis is fitted against.
"""

from __future__ import annotations

import json
import sys
from typing import Any

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


def measure_peak(config_path: str, batch: int) -> dict[str, Any]:
    """Build the trial at `batch` and run PROBE_STEPS steps; its peak memory (MiB)."""
    from omegaconf import OmegaConf

    from gpuopt.engines.registry import engine_entry, load_spec
    from gpuopt.trial.devices import trial_device
    from gpuopt.trial.measure import synchronize
    from gpuopt.trial.memory import MemoryBaseline

    cfg = OmegaConf.load(config_path)
    cfg.loader.batch_size = batch
    cfg.loader.num_workers = 0
    spec = load_spec(cfg)
    device, _ = trial_device(spec)
    memory = MemoryBaseline.take(device)  # before anything is built: a CPU's peak RSS from here
    out: dict[str, Any] = {"batch": batch, "device": device.type}
    step = engine_entry("native", "repeated_step")(spec, device)  # gpuopt's own loop builds it
    memory.window_starting()
    for _ in range(PROBE_STEPS):
        step()
    synchronize(device)
    out["peak_mb"] = memory.peak_mb()
    if device.type == "cuda":
        import torch

        out["device_memory_mb"] = torch.cuda.get_device_properties(device).total_memory / 2**20
    out["available_ram_mb"] = available_ram_mb()
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m gpuopt.trial.memory_probe CONFIG.yaml BATCH", file=sys.stderr)
        return 2
    try:
        data = measure_peak(args[0], int(args[1]))
    except Exception as exc:  # an OOM at the probe's size is an answer too: the sweeper logs it
        data = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    print(json.dumps(data, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
