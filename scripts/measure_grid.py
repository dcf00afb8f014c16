"""Measure every configuration of a reference search space once, for the search-efficiency replay.

    python scripts/measure_grid.py                      # writes benchmarks/grid_cpu.json (~5-10 min)
    python scripts/measure_grid.py --resume             # continue an interrupted grid

The grid is a full factorial over SPACE (Hydra sweep strings, exactly as a sweeper preset writes
them) on a fixed CPU workload, measured with the real engine (`gpuopt.run.run_config`) in this one
process with a short window (measure=quick). Configurations run in a seeded random order, so slow
drift of the machine spreads over the grid instead of lining up with one axis. scripts/replay.py then
answers samplers' asks from the file (scripts/bench_search.py, tests/test_replay.py).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from replay import DEFAULT_GRID_PATH, Grid, GridPoint

from gpuopt.core.knobs import canonical, judge
from gpuopt.sweeper.machine import probe_env

# The reference space: the keys the default preset (conf/search/default.yaml) searches on a CPU
# (batch size; loader workers and compute threads, which share the cores; precision), each with more
# values than the preset, including the ones gpuopt's device-aware trimming drops on 2 cores (4
# workers, 4 threads, bf16): the replay then shows what that trimming is worth.
# On the input-bound MLP workload. 6 x 4 x 3 x 2 = 144 configurations.
SPACE = {
    "loader.batch_size": "choice(16,32,64,128,256,512)",
    "loader.num_workers": "choice(0,1,2,4)",
    "device.num_threads": "choice(1,2,4)",
    "precision": "choice(fp32,bf16)",
}
FIXED = ["model=mlp", "device=cpu", "measure=quick", *benchlib.LEAN_MEASURE]
# Kept from each result besides the objective (throughput).
EXTRA_METRICS = (
    "utilization",
    "data_wait",
    "step_time_ms",
    "throughput_ci",
    "peak_memory_mb",
    "timed_steps",
    # What the expert seeds reason from (gpuopt/sweeper/seeding.py; scripts/replay.py reads these
    # when present, else derives the costs from data_wait). compute_cost_us and ceiling_throughput
    # need the ceiling replay: `measure.ceiling=true` among the overrides.
    "loader_cost_us",
    "compute_cost_us",
    "ceiling_throughput",
    "limit_bound",
)


def grid_configs(space: dict[str, str]) -> list[dict[str, object]]:
    """Every combination of the space's choices, with the values Hydra's parser gives them."""
    grid = Grid(space=space, points=[])
    dists = grid.distributions()
    return [
        dict(zip(dists, combo, strict=False))
        for combo in itertools.product(*(d.choices for d in dists.values()))
    ]  # type: ignore[attr-defined]


def poor_choices(facts: dict, configs: list[dict]) -> dict[str, dict[str, str]]:
    """The grid's values the knob catalogue's rules call poor on this machine: {key: {value: why}}
    (what replay.py's device-aware setup drops)."""
    poor: dict[str, dict[str, str]] = {}
    for key, value in {(k, canonical(v)) for c in configs for k, v in c.items()}:
        if why := judge(key, value, facts):
            poor.setdefault(key, {})[value] = why
    return poor


def override(key: str, value: object) -> str:
    from gpuopt.sweeper.space import override_text

    return override_text(key, value)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_GRID_PATH)
    parser.add_argument("--resume", action="store_true", help="keep the points already in --out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the measuring order")
    parser.add_argument(
        "--limit", type=int, default=None, help="measure only this many (a trial run)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="extra fixed overrides for every configuration"
    )
    args = parser.parse_args()

    fixed = FIXED + list(args.overrides)
    configs = grid_configs(SPACE)
    random.Random(args.seed).shuffle(configs)
    done: list[GridPoint] = []
    meta = {}
    if args.resume and args.out.exists():
        previous = Grid.load(args.out)
        done, meta = list(previous.points), previous.meta
        meta["measure_seconds_before"] = meta.get("measure_seconds", 0.0)
    measured = {tuple(sorted((k, str(v)) for k, v in p.params.items())) for p in done}
    todo = [c for c in configs if tuple(sorted((k, str(v)) for k, v in c.items())) not in measured]
    todo = todo[: args.limit] if args.limit else todo

    meta = meta or {
        "command": benchlib.command_line(),
        "date": benchlib.now(),
        "machine": benchlib.machine(),
        "fixed_overrides": fixed,
        "how": "in-process run_config per configuration (one warm process), seeded random order",
        "load_before": benchlib.load(),
        # what `python -m gpuopt.env --json` flags as poor here: the sweeper's device-aware trimming
        "poor_choices": poor_choices(probe_env().data, configs),
    }
    print(
        f"{len(configs)} configurations, {len(done)} already measured, {len(todo)} to go; load {benchlib.load()}"
    )
    runner = benchlib.InProcessRunner()
    t0 = time.perf_counter()
    try:
        for i, params in enumerate(todo, start=1):
            result = runner.run(fixed + [override(k, v) for k, v in params.items()])
            metrics = result.get("metrics") or {}
            extra = {k: metrics.get(k) for k in EXTRA_METRICS}
            extra["wall_s"] = round(result["wall_s"], 2)
            if result.get("reason"):
                extra["reason"] = result["reason"]
            done.append(GridPoint(params, result["status"], metrics.get("throughput"), extra))
            print(
                f"[{i}/{len(todo)}] {params} -> {benchlib.fmt(metrics.get('throughput'))} samples/s ({result['status']})"
            )
            if i % 10 == 0 or i == len(todo):  # save as we go: --resume continues from here
                _save(args.out, done, meta, time.perf_counter() - t0)
    finally:
        runner.close()
        _save(args.out, done, meta, time.perf_counter() - t0)
    grid = Grid.load(args.out)
    best = grid.best() if any(p.ok for p in grid.points) else None
    print(
        f"saved {len(grid.points)} points to {args.out}; complete: {grid.is_complete()}; best: {best}"
    )


def _save(path: Path, points: list[GridPoint], meta: dict, seconds: float) -> None:
    """`seconds`: this session's measuring time, added to earlier sessions' (--resume)."""
    total = meta.get("measure_seconds_before", 0.0) + seconds
    meta = dict(meta, load_after=benchlib.load(), measure_seconds=round(total, 1))
    Grid(space=SPACE, points=points, meta=meta).save(path)


if __name__ == "__main__":
    main()
