"""The measured matmul peak: a short probe per device and precision mode, cached per hardware
fingerprint, so MFU has an achievable reference beside the datasheet's (and CPUs get one at all).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuopt.core.host import usable_cpus
from gpuopt.core.machine_cache import HARDWARE_KEYS, cache_dir, read_json, write_json
from gpuopt.trial.devices import fingerprint

if TYPE_CHECKING:
    import torch

# Precision mode -> (torch dtype name, float32 matmul precision the probe runs under).
PROBE_MODES = {
    "fp32": ("float32", "highest"),
    "tf32": ("float32", "high"),
    "bf16": ("bfloat16", "highest"),
    "fp16": ("float16", "highest"),
}
PROBE_BUDGET_S = 0.2  # per dtype, first measurement on a machine; later calls read the cache
PROBE_REPS = 5  # timed repetitions per size (best of)


def measure_peak_flops(device: torch.device, mode: str) -> float:
    """Achievable dense matmul FLOP/s for a precision mode: the best of PROBE_REPS square matmuls
    (after one untimed) of growing size until the next would not fit the budget (a slow, emulated
    dtype stops at small sizes)."""
    import time

    import torch

    from gpuopt.trial.measure import synchronize

    dtype_name, matmul_precision = PROBE_MODES[mode]
    n, max_n = (128, 2048) if device.type == "cpu" else (1024, 8192)  # the sizes: first, largest
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    deadline = time.perf_counter() + PROBE_BUDGET_S
    best = 0.0
    try:
        while True:
            a, b = (torch.randn(n, n, device=device).to(getattr(torch, dtype_name)) for _ in "ab")
            a @ b
            synchronize(device)
            seconds = float("inf")
            for _ in range(PROBE_REPS):
                started = time.perf_counter()
                a @ b
                synchronize(device)
                seconds = min(seconds, time.perf_counter() - started)
                if time.perf_counter() >= deadline:
                    break
            best = max(best, 2 * n**3 / seconds)
            # The next size costs ~8x per matmul, PROBE_REPS + 1 of them.
            if n * 2 > max_n or 8 * seconds * (PROBE_REPS + 1) > deadline - time.perf_counter():
                return best
            n *= 2
    finally:
        torch.set_float32_matmul_precision(previous)


def probed_peak_flops(
    device: torch.device, mode: str, fp: dict[str, Any] | None = None, cache: Path | None = None
) -> float | None:
    """The measured peak FLOP/s of `device` for a precision mode, cached or probed now (None for
    a mode the probe does not know). On CPU the probe runs on one thread, times the usable cores:
    a probe on every core of a shared machine times its slowest thread (OpenMP's barriers wait
    for a descheduled one) and would cache a fraction of the machine."""
    import torch

    if mode not in PROBE_MODES:
        return None
    fp = fp if fp is not None else fingerprint(device)
    threads = 1 if device.type == "cpu" else torch.get_num_threads()
    scale = usable_cpus() if device.type == "cpu" else 1
    path = cache if cache is not None else cache_dir() / "peak_flops.json"
    # A new torch can bring new kernels: its version is in the key.
    hardware = {k: fp.get(k) for k in HARDWARE_KEYS}
    key = json.dumps(
        {"hardware": hardware, "mode": mode, "threads": threads, "torch": fp.get("torch")},
        sort_keys=True,
    )
    cached = read_json(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("flops"), (int, float)):
        return float(cached["flops"]) * scale
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = measure_peak_flops(device, mode)
    finally:
        torch.set_num_threads(previous)
    data = read_json(path)  # re-read: another process may have written meanwhile
    data[key] = {"flops": flops, "threads": threads}
    write_json(path, data)
    return flops * scale
