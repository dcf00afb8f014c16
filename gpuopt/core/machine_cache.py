"""What gpuopt measured about this machine once and keeps, in `cache_dir()`: the sweep's machine
probe, the matmul peak, and the run-to-run spread of one workload's throughput between fresh
processes (`run_spread.json`, stored by scripts/bench_noise.py): a trial's own interval covers one
window only, while fresh processes read 4-25% apart on a 2-core CPU. Torch-free: the spread's key
is built from a result's recorded fingerprint (`env`) and resolved config.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The fingerprint fields that name the hardware (and driver) a measurement ran on.
HARDWARE_KEYS = (
    "device_name",
    "cpu_model",
    "usable_cpus",
    "compute_capability",
    "device_memory_mb",
    "driver",
    "hostname",
)
SPREAD_FILE = "run_spread.json"
# The parts of a resolved config that name the workload (what is trained and on what): the
# knobs a sweep searches (loader, precision, threads, ...) are not part of it, so one spread
# measured at one configuration serves every configuration of the workload.
WORKLOAD_KEYS = ("model", "data", "engine", "loss")


def cache_dir() -> Path:
    """Where gpuopt caches measurements of the machine: $GPUOPT_CACHE_DIR, else
    $XDG_CACHE_HOME/gpuopt, else ~/.cache/gpuopt."""
    explicit = os.environ.get("GPUOPT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuopt"


def read_json(path: Path) -> dict[str, Any]:
    """A cache file's entries; {} when it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically (trials in parallel processes may write at once: the last writer wins)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time, nothing else breaks


@dataclass(frozen=True)
class RunSpread:
    """The coefficient of variation (a fraction) of fresh processes' throughput, over `runs`."""

    cv: float
    runs: int
    date: str = ""
    by: str = "scripts/bench_noise.py"

    @classmethod
    def from_json(cls, data: Any) -> RunSpread | None:
        if not isinstance(data, dict):
            return None
        cv, runs = data.get("cv"), data.get("runs")
        if not isinstance(cv, (int, float)) or not isinstance(runs, int) or cv < 0 or runs < 2:
            return None
        return cls(float(cv), runs, str(data.get("date") or ""), str(data.get("by") or ""))


def spread_key(env: dict[str, Any], config: dict[str, Any]) -> str:
    """The store's key: the hardware (HARDWARE_KEYS, device type, torch) and the workload."""
    hardware = {k: env.get(k) for k in HARDWARE_KEYS}
    device = str(env.get("device") or "").split(":")[0]
    workload = {k: config.get(k) for k in WORKLOAD_KEYS}
    return json.dumps(
        {"hardware": hardware, "device": device, "torch": env.get("torch"), "workload": workload},
        sort_keys=True,
        default=str,
    )


def read_spread(
    env: dict[str, Any], config: dict[str, Any], path: Path | None = None
) -> RunSpread | None:
    """The stored spread of this workload on this machine, or None: not measured here."""
    store = read_json(path if path is not None else cache_dir() / SPREAD_FILE)
    return RunSpread.from_json(store.get(spread_key(env, config)))


def save_spread(
    env: dict[str, Any], config: dict[str, Any], spread: RunSpread, path: Path | None = None
) -> Path:
    """Store (or replace) this workload's spread on this machine; the file written."""
    target = path if path is not None else cache_dir() / SPREAD_FILE
    store = read_json(target)
    store[spread_key(env, config)] = asdict(spread)
    write_json(target, store)
    return target
