"""Shared helpers of the benchmark scripts: run gpuopt trials (fresh process or in-process),
interleave arms A B A B, record the machine and its load. Not part of the package: scripts only.

Fresh processes (`python -m gpuopt.run`) are what the sweeper's default launcher measures; every
comparison here runs all its arms the same way, because a warm process reads 10-35% faster than a
fresh one on a 2-core machine.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Arms alternate their order every other round, as the sweeper's confirmation round does.
from gpuopt.sweeper.comparison import round_order

REPO = Path(__file__).resolve().parent.parent
# Benchmarks time the training step, not the extras: no ceiling replay, no FLOP counting.
LEAN_MEASURE = ["measure.ceiling=false", "measure.count_flops=false"]


def load() -> str:
    """The 1/5/15-minute load averages, for the record (2 shared cores: anything > 0.5 matters)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def machine() -> dict[str, Any]:
    from gpuopt.core.host import cpu_model, usable_cpus

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpus": usable_cpus(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def command_line() -> str:
    return "python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]
    )


def run_fresh(overrides: Sequence[str], timeout_s: float = 600.0) -> dict[str, Any]:
    """Measure one configuration in a fresh `python -m gpuopt.run` process; its result.json as a
    dict, plus `wall_s` (process wall time). A crash or timeout comes back as status `error`."""
    with tempfile.TemporaryDirectory(prefix="gpuopt_bench_") as tmp:
        cmd = [sys.executable, "-m", "gpuopt.run", *overrides, f"hydra.run.dir={tmp}"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return {
                "status": "error",
                "reason": f"timeout after {timeout_s} s",
                "metrics": {},
                "wall_s": timeout_s,
            }
        wall = time.perf_counter() - t0
        result_file = Path(tmp) / "result.json"
        if not result_file.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"status": "error", "reason": " | ".join(tail), "metrics": {}, "wall_s": wall}
        result = json.loads(result_file.read_text())
        result["wall_s"] = wall
        return result


class InProcessRunner:
    """Measure many configurations in this process with the real engine (`gpuopt.run.run_config`
    on a Hydra-composed config): ~10x cheaper than a process per trial, for the reference grid.
    Every config must set the process-wide knobs it depends on (e.g. device.num_threads) explicitly:
    a null would inherit the previous trial's setting."""

    def __init__(self) -> None:
        from hydra import initialize_config_module

        import gpuopt.run  # noqa: F401  (registers the schema)

        self._context = initialize_config_module(config_module="gpuopt.conf")
        self._context.__enter__()

    def run(self, overrides: Sequence[str]) -> dict[str, Any]:
        from hydra import compose

        from gpuopt.run import run_config

        t0 = time.perf_counter()
        cfg = compose(config_name="config", overrides=list(overrides))
        result = run_config(cfg, output_dir=None, multirun=True).to_dict()
        result["wall_s"] = time.perf_counter() - t0
        return result

    def close(self) -> None:
        self._context.__exit__(None, None, None)


def throughput(result: Mapping[str, Any]) -> float | None:
    if result.get("status") != "ok":
        return None
    return (result.get("metrics") or {}).get("throughput")


def interleave(
    arms: Mapping[str, Sequence[str]],
    repeats: int,
    run: Callable[[Sequence[str]], dict[str, Any]] = run_fresh,
    log: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """Measure every arm `repeats` times in the order A B C C B A A B C ... (round_order):
    interleaving makes slow drift of the machine hit all arms alike, alternating cancels
    position effects."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for r in range(repeats):
        for name in round_order(list(arms), r):
            result = run(arms[name])
            results[name].append(result)
            log(
                f"  repeat {r + 1}/{repeats} {name:<12} {fmt(throughput(result))} samples/s "
                f"({result.get('status')}, {result.get('wall_s', 0):.1f} s)"
            )
    return results


def median_throughput(results: Sequence[Mapping[str, Any]]) -> float | None:
    values = [v for v in map(throughput, results) if v is not None]
    return statistics.median(values) if values else None


def spread(results: Sequence[Mapping[str, Any]]) -> float | None:
    """(max - min) / median of the repeats' throughputs: how far apart fresh processes read."""
    values = [v for v in map(throughput, results) if v is not None]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def write_json(path: str | Path, data: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def composed_configs(folder: Path, arms: Mapping[str, Sequence[str]]) -> dict[str, Path]:
    """Each arm's overrides composed as gpuopt's app composes a job (Hydra config included) and
    written as `<label>.yaml` in `folder`: what the shared process (gpuopt.processes.shared_windows) builds."""
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401 - registers the schemas
    from gpuopt.sweeper.shared_process import write_config

    paths = {}
    for label, overrides in arms.items():
        with initialize_config_module(config_module="gpuopt.conf"):
            cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        paths[label] = write_config(cfg, folder, f"{label}.yaml")
    return paths
