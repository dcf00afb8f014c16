"""The shared process's idle wait (settle), on and off: does another configuration's loading leak
into the baseline's windows?

    python scripts/bench_settle.py --rounds 20 --json benchmarks/settle_cpu.json

Two configurations of the default MLP share one process (gpuopt.processes.shared_windows, as the race and
the in-process confirmation run them): the baseline (batch 32, no loader workers, the default
compute threads) and a candidate (batch 512, `--workers` loader workers, one thread). Rounds of
B C windows (`--window-s`), in blocks that alternate settle on / off (`settle`: after each window,
wait until this process's children - the candidate's workers refilling their prefetch queue - are
idle). Reported per mode: the baseline's window throughput (median, min, spread), the candidate's,
and the ratio C/B per round (median and its spread): with the leak, the baseline reads low and
the ratio high.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from gpuopt.sweeper.shared_process import SharedProcess

BASE = ["device=cpu", "loader.batch_size=32", "loader.num_workers=0"]


def configs(folder: Path, workers: int) -> dict[str, Path]:
    candidate = ["loader.batch_size=512", f"loader.num_workers={workers}", "device.num_threads=1"]
    return benchlib.composed_configs(
        folder, {"baseline": BASE, "candidate": ["device=cpu", *candidate]}
    )


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "cv": statistics.pstdev(values) / statistics.fmean(values),
        "n": len(values),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="B C rounds per mode")
    parser.add_argument("--block", type=int, default=5, help="rounds before the mode switches")
    parser.add_argument("--window-s", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="gpuopt-settle-"))
    race = SharedProcess.open(folder, "throughput", args.window_s)
    readings: dict[bool, dict[str, list[float]]] = {
        m: {"b": [], "c": [], "r": []} for m in (True, False)
    }
    try:
        for label, path in configs(folder, args.workers).items():
            assert race.add(label, path).status == "ok", race.error
        for i in range(2 * args.rounds):
            settle = (i // args.block) % 2 == 0
            b = race.measure("baseline", args.window_s, 3, settle=settle).throughput
            c = race.measure("candidate", args.window_s, 3, settle=settle).throughput
            mode = readings[settle]
            mode["b"].append(b)
            mode["c"].append(c)
            mode["r"].append(c / b)
    finally:
        race.close()
    out = {
        ("settle on" if m else "settle off"): {k: summary(v) for k, v in r.items()}
        for m, r in readings.items()
    }
    for mode, stats in out.items():
        print(
            f"{mode}: baseline {stats['b']['median']:.0f} samples/s (min {stats['b']['min']:.0f}, "
            f"cv {100 * stats['b']['cv']:.1f}%), candidate {stats['c']['median']:.0f} "
            f"(cv {100 * stats['c']['cv']:.1f}%), ratio {stats['r']['median']:.3f}x "
            f"(cv {100 * stats['r']['cv']:.1f}%), {stats['r']['n']} rounds"
        )
    if args.json:
        benchlib.write_json(
            args.json, {"machine": benchlib.machine(), "command": benchlib.command_line(), **out}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
