"""What machine the study measures, without importing torch in the sweeping process.

The env probe (`python -m gpuopt.env --json`) runs in a subprocess and is cached under what it
depends on (`probe_key`), saving ~2 s of every sweep's start; `hardware_id` is part of the
default study name, so one study never mixes machines."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuopt.core import machine_cache
from gpuopt.core.host import cpu_model
from gpuopt.sweeper.launchers.gpus import nvml_strings, setup_line

log = logging.getLogger(__name__)


@dataclass
class EnvProbe:
    """What `python -m gpuopt.env --json` said (empty when it could not run)."""

    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def device_type(self) -> str | None:
        """The facts' device type (cpu | cuda | mps: gpuopt.trial.devices.detect_capabilities)."""
        return self.data.get("device") or None


PROBE_FILE = "env_probe.json"
PROBE_KEEP = 8  # probes kept (machines, interpreters, GPU sets); the least recently made goes
# The modules whose code makes the probe's answer: a change to one is a new key.
PROBE_SOURCES = ("env.py", "core/knobs.py", "trial/devices.py", "trial/matmul_peak.py")


def probe_key(python: str) -> str:
    """What the probe's answer depends on: the hardware, the CPUs and GPUs this process may use,
    the interpreter, torch's version, and the code that makes the answer."""
    from importlib import metadata

    root = Path(__file__).resolve().parents[1]
    sources = []
    for name in PROBE_SOURCES:
        try:
            stat = (root / name).stat()
            sources.append((name, stat.st_size, stat.st_mtime_ns))
        except OSError:
            sources.append((name, None, None))
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    facts = {
        **hardware_facts(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "host": platform.node(),
        "python": python,
        "torch": torch_version,
        "sources": sources,
    }
    return json.dumps(facts, sort_keys=True, default=str)


def probe_env(timeout_s: float = 120.0, python: str | None = None) -> EnvProbe:
    """What `python -m gpuopt.env --json` says here: kept from an earlier sweep under the same
    `probe_key`, else run in a subprocess (and kept when it worked); never raises."""
    python = python or sys.executable
    path = machine_cache.cache_dir() / PROBE_FILE
    key = probe_key(python)
    kept = machine_cache.read_json(path)
    entry = kept.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("data"), dict):
        return EnvProbe(data=entry["data"])
    probe = _run_probe(timeout_s, python)
    if not probe.error:
        others = [(k, v) for k, v in kept.items() if k != key and isinstance(v, dict)]
        newest = sorted(others, key=lambda kv: kv[1].get("made", 0.0))[-(PROBE_KEEP - 1) :]
        made = {"made": time.time(), "data": probe.data}
        machine_cache.write_json(path, {**dict(newest), key: made})
    return probe


def _run_probe(timeout_s: float, python: str) -> EnvProbe:
    """Run `python -m gpuopt.env --json` in a subprocess; never raises."""
    cmd = [python, "-m", "gpuopt.env", "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return EnvProbe(error=f"{' '.join(cmd)}: {type(exc).__name__}: {exc}")
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return EnvProbe(error=f"{' '.join(cmd)} exited {proc.returncode}: {tail[0]}")
    text = proc.stdout.strip()
    start = text.find("{")
    try:
        data = json.loads(text[start:]) if start >= 0 else None
    except json.JSONDecodeError as exc:
        return EnvProbe(error=f"{' '.join(cmd)} printed no JSON object ({exc})")
    if not isinstance(data, dict):
        return EnvProbe(error=f"{' '.join(cmd)} printed no JSON object")
    return EnvProbe(data=data)


def hardware_facts() -> dict[str, Any]:
    """The machine's facts behind `hardware_id` (GPU names through NVML: no torch)."""
    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": nvml_strings("nvmlDeviceGetName"),
    }


def hardware_id(facts: dict[str, Any]) -> str:
    """The hardware's short readable id: the accelerator (or CPU core count) plus a hash of the facts."""
    digest = hashlib.sha1(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:6]
    gpus = facts.get("gpus") or []
    if gpus:
        head = re.sub(r"[^a-z0-9]+", "", str(gpus[0]).lower().replace("nvidia", ""))[:12] or "gpu"
        head = f"{len(gpus)}x{head}" if len(gpus) > 1 else head
    else:
        head = f"cpu{facts.get('cpu_count') or ''}"
    return f"{head}-{digest}"


def detect_device_type(config_device: str | None, facts: dict[str, Any]) -> str:
    """The device trials run on: the config's device.type, or what `auto` picks (cuda, mps, cpu)."""
    if config_device and config_device != "auto":
        return str(config_device).split(":")[0]
    if facts.get("gpus"):
        return "cuda"
    if facts.get("system") == "Darwin" and facts.get("machine") == "arm64":
        return "mps"
    return "cpu"


def default_study_name(workload: str | None, search: str | None, hardware_id: str) -> str:
    parts = [p for p in (workload, search) if p]
    safe = [re.sub(r"[^A-Za-z0-9_.-]+", "_", str(p)) for p in parts]
    return "-".join([*safe, hardware_id]) if safe else f"gpuopt-{hardware_id}"


def gpu_setup_command(environ: dict[str, str]) -> str:
    """A shell line that gives a fresh trial process the GPUs this process sees: submitit's local
    launcher sets CUDA_VISIBLE_DEVICES to the first `gpus_per_node` indices (none by default); its
    `setup` lines run after that."""
    return setup_line(environ.get("CUDA_VISIBLE_DEVICES"))
