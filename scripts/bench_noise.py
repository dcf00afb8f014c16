"""Measurement noise and accuracy of gpuopt's timing against an independent, plain training loop.

For each of N rounds (interleaved, the order reversed every other round, each in a fresh process):
  1. `python -m gpuopt.run <config>`: gpuopt measures the configuration; we read result.json.
  2. `python scripts/bench_noise.py --independent <config>`: the same model, data, loader and
     optimizer, timed by a plain loop written here (no gpuopt.trial.measure / gpuopt.trial code): warm up,
     then run steps until a fixed wall-time budget, throughput = samples / elapsed.

Reports both throughputs, their ratio, both coefficients of variation across processes, and the
startup overhead (process start -> first timed step). Targets: gpuopt within 3% of the independent
timing; gpuopt's CV no worse than the independent one; the default measurement <= 15 s per trial.

It then stores gpuopt's run-to-run spread (the coefficient of variation of its throughput across
the fresh processes) for this machine and workload in gpuopt's cache folder
(gpuopt.core.machine_cache, beside the matmul peak): `python -m gpuopt.run` reports it beside
the window's own interval, and a sweep's summary and report use it to say which trials are
within noise of each other (`--no-save`: keep nothing).

`--spread-only` measures the spread of any workload (the overrides given, e.g. `model=cnn`, on
the device they pick) without the independent loop, which rebuilds only the default MLP.

Usage: python scripts/bench_noise.py [--rounds 5] [--budget 8] [--spread-only] [-- extra hydra overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

REPO = Path(__file__).resolve().parents[1]
# The configuration measured: the default config (MLP, batch 32, synthetic data with sample_cost=1 and
# its default 262,144-sample epoch, so neither arm restarts an epoch inside its timed span; no workers) on the CPU with one compute thread (with two, OpenMP's barriers make every number
# hostage to whatever else runs on a shared 2-core machine). The independent loop rebuilds exactly this.
CONFIG = {
    "in_features": 256, "out_features": 10, "width": 512, "depth": 3,
    "batch_size": 32, "size": 262144, "sample_cost": 1.0, "seed": 0, "lr": 1e-3, "threads": 1,
}  # fmt: skip
GPUOPT_OVERRIDES = ["device=cpu", f"device.num_threads={CONFIG['threads']}"]
WARMUP_STEPS = 5  # gpuopt's default measure.warmup_steps


def process_age_s() -> float:
    """Seconds since this process started (/proc, independent of gpuopt's helper)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - ticks / os.sysconf("SC_CLK_TCK")


def independent_child(budget_s: float) -> None:
    """A plain training loop timed with perf_counter around the whole timed span."""
    import torch
    from torch.utils.data import DataLoader

    from gpuopt.workload.data import SyntheticDataset
    from gpuopt.workload.models import MLP

    c = CONFIG
    torch.set_num_threads(c["threads"])
    torch.manual_seed(c["seed"])
    model = MLP(c["in_features"], c["out_features"], c["width"], c["depth"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=c["lr"])
    data = SyntheticDataset(
        "vectors", [c["in_features"]], c["out_features"], c["size"], c["sample_cost"], c["seed"]
    )
    loader = DataLoader(data, batch_size=c["batch_size"], shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(c["seed"]))  # fmt: skip

    def batches():
        while True:
            yield from loader

    stream = batches()

    def step():
        x, y = next(stream)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(WARMUP_STEPS + 1):  # +1: gpuopt's FLOP-counting step also runs before its window
        step()
    startup = process_age_s()
    steps, start = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            break
    print(json.dumps({"throughput": steps * c["batch_size"] / elapsed, "steps": steps,
                      "seconds": elapsed, "startup_s": startup}))  # fmt: skip


def run_gpuopt(out_dir: Path, extra: list[str], forced: list[str] = GPUOPT_OVERRIDES) -> dict:
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(out_dir)}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "gpuopt.run", *forced, *extra],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"gpuopt run failed:\n{proc.stderr[-2000:]}")
    newest = max(out_dir.glob("runs/*/*/result.json"), key=lambda p: p.stat().st_mtime)
    result = json.loads(newest.read_text())
    m = result["metrics"]
    # Measurement cost: warm-up, then everything from the first timed step to process exit (window,
    # compute ceiling, writing the result): conservative, it includes the interpreter's shutdown.
    measured = (m["warmup_time_s"] or 0) + (m["compile_time_s"] or 0) + wall - m["startup_time_s"]
    return {"throughput": m["throughput"], "steps": m["timed_steps"], "seconds": m["timed_seconds"],
            "stop": m["stop_reason"], "ci": m["throughput_ci"], "startup_s": m["startup_time_s"],
            "amortized": m.get("throughput_amortized"), "limit_efficiency": m.get("limit_efficiency"),
            "process_wall_s": wall, "measure_s": measured, "status": result["status"],
            "env": result["env"], "config": result["config"]}  # fmt: skip


def run_independent(budget_s: float) -> dict:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--independent", "--budget", str(budget_s)],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    data["process_wall_s"] = time.perf_counter() - started
    return data


def cv(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else 0.0


MIN_SAVED_RUNS = 3  # a spread from two processes is one difference: not stored


def save_spread(runs: list[dict]) -> None:
    """Store gpuopt's run-to-run spread for this machine and workload (the first run's recorded
    fingerprint and resolved config name both: gpuopt.core.machine_cache.spread_key)."""
    from gpuopt.core.machine_cache import RunSpread
    from gpuopt.core.machine_cache import save_spread as store

    if len(runs) < MIN_SAVED_RUNS:
        print(f"spread not stored: {len(runs)} runs (at least {MIN_SAVED_RUNS})")
        return
    spread = RunSpread(cv([r["throughput"] for r in runs]), len(runs), time.strftime("%Y-%m-%d"))
    path = store(runs[0]["env"], runs[0]["config"], spread)
    print(f"run-to-run spread {100 * spread.cv:.1f}% over {spread.runs} fresh processes stored in "
          f"{path}: python -m gpuopt.run and the sweep's summary read it")  # fmt: skip


def spread_only(rounds: int, overrides: list[str], save: bool) -> None:
    """Fresh gpuopt processes of one workload, nothing else: its run-to-run spread here."""
    print(f"# bench_noise --spread-only: {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}: "
          f"python -m gpuopt.run {' '.join(overrides)}, {rounds} fresh processes")  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            runs.append(run_gpuopt(Path(tmp), overrides, forced=[]))
            r = runs[-1]
            print(f"run {i + 1}: {r['throughput']:8.1f} samples/s ({r['steps']} steps, "
                  f"ci {100 * (r['ci'] or 0):.1f}%)", flush=True)  # fmt: skip
    print(f"CV across processes: {100 * cv([r['throughput'] for r in runs]):.1f}%")
    if save:
        save_spread(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--budget", type=float, default=8.0, help="independent loop's timed seconds"
    )
    parser.add_argument("--independent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--spread-only", action="store_true", help="gpuopt's runs only: the workload's spread"
    )
    parser.add_argument("--no-save", action="store_true", help="do not store the spread")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the gpuopt run")
    args = parser.parse_args()
    if args.independent:
        independent_child(args.budget)
        return
    if args.spread_only:
        spread_only(args.rounds, args.overrides, save=not args.no_save)
        return

    print(f"# bench_noise: {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, {os.cpu_count()} CPUs, "
          f"load average at start {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"# gpuopt: python -m gpuopt.run {' '.join(GPUOPT_OVERRIDES + args.overrides)}")
    print(
        f"# independent: plain loop, {args.budget:.0f} s timed after {WARMUP_STEPS + 1} warm-up steps"
    )
    gp, ind = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            arms = {
                "gpuopt": lambda: gp.append(run_gpuopt(Path(tmp), args.overrides)),
                "independent": lambda: ind.append(run_independent(args.budget)),
            }
            for name in benchlib.round_order(list(arms), i):  # A B, B A, ...
                arms[name]()
            g, r = gp[-1], ind[-1]
            print(f"round {i + 1}: gpuopt {g['throughput']:8.1f} samples/s ({g['steps']} steps, {g['seconds']:.2f} s, "
                  f"{g['stop']}, ci {100 * (g['ci'] or 0):.1f}%, measure {g['measure_s']:.1f} s, process {g['process_wall_s']:.1f} s) | "
                  f"independent {r['throughput']:8.1f} samples/s ({r['steps']} steps, {r['seconds']:.2f} s)",
                  flush=True)  # fmt: skip
    g_thr = [g["throughput"] for g in gp]
    i_thr = [r["throughput"] for r in ind]
    ratio = statistics.median(g_thr) / statistics.median(i_thr)
    summary = {
        "gpuopt_median": statistics.median(g_thr), "independent_median": statistics.median(i_thr),
        "ratio": ratio,
        # Each round's two runs are neighbours in time: their ratio cancels slow load drift.
        "ratio_of_pairs_median": statistics.median(g / i for g, i in zip(g_thr, i_thr, strict=False)),
        "gpuopt_cv": cv(g_thr), "independent_cv": cv(i_thr),
        "gpuopt_startup_s": statistics.median(g["startup_s"] for g in gp),
        "independent_startup_s": statistics.median(r["startup_s"] for r in ind),
        "gpuopt_measure_s_max": max(g["measure_s"] for g in gp),
        "gpuopt_process_wall_s_median": statistics.median(g["process_wall_s"] for g in gp),
        "load_average_end": os.getloadavg()[0],
    }  # fmt: skip
    print(json.dumps(summary, indent=2))
    print(
        f"throughput ratio gpuopt/independent = {ratio:.3f} (medians; per-round pairs: "
        f"{summary['ratio_of_pairs_median']:.3f}) (target 0.97-1.03): "
        f"{'met' if abs(ratio - 1) <= 0.03 else 'MISSED'}"
    )
    print(
        f"CV across processes: gpuopt {100 * summary['gpuopt_cv']:.1f}% vs independent "
        f"{100 * summary['independent_cv']:.1f}%: {'met' if summary['gpuopt_cv'] <= summary['independent_cv'] else 'MISSED'}"
    )
    print(
        f"longest gpuopt measurement (warm-up, window, ceiling, exit) {summary['gpuopt_measure_s_max']:.1f} s "
        f"(target <= 15 s): {'met' if summary['gpuopt_measure_s_max'] <= 15 else 'MISSED'}"
    )
    print(f"startup (process start -> first timed step): gpuopt {summary['gpuopt_startup_s']:.1f} s, "
          f"independent {summary['independent_startup_s']:.1f} s")  # fmt: skip
    if not args.no_save:
        save_spread(gp)


if __name__ == "__main__":
    main()
