"""Answer (a) on the shipped grids: does the default search find the best same-training configuration?

    python scripts/bench_same_training.py                # both shipped grids, 10 seeds (~1 min)
    python scripts/bench_same_training.py --seeds 20 --json out.json

Replays each measured grid (scripts/replay.py) with gpuopt's default search as
`python -m gpuopt.run -m` runs it (its sampler, objectives, baseline, device-aware trimming, expert
seeds with the same-training ones, the race with its same-training finalist) for the default
preset's n_trials, and reads what answer (a) could be: the best whole trial (told with values,
so measured and confirmable) that keeps the baseline's global batch, the baseline included.
Counts the seeds where it reaches 95% of the grid's best same-training configuration (issue 34's
goal: >= 9 of 10, as P3 is for the overall best); the second row is the search as it was before
issue 34 (no same-training seeds, no same-training finalist), for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from replay import Contender, Grid, SameTrainingReach, gpuopt_contenders, same_training_reach

GRIDS = ("grid_cpu.json", "grid_cpu_cnn.json")
FRACTION = 0.95


def before_issue_34(contender: Contender) -> Contender:
    """The default search as it was: the seeds at the two largest batches only, no share held at
    the baseline's global batch, no same-training finalist (answer (a) still read by the rule)."""
    setup = contender.setup
    seeds = [p for p in setup.enqueue[1:] if not setup.rule.holds(p)]
    before = dataclasses.replace(
        setup, enqueue=(setup.enqueue[0], *seeds), race_same_training=False
    )
    return Contender(contender.name + " before issue 34", contender.factory, before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    rows, results = [], []
    for name in GRIDS:
        grid = Grid.load(root / name)
        ours = gpuopt_contenders(grid, sampler_only=False)[0]
        for contender in (ours, before_issue_34(ours)):
            reach = same_training_reach(grid, contender, range(args.seeds))
            rows.append(_row(name, reach, args.seeds))
            results.append({"grid": name, **_record(reach)})
    print("| grid | search | best same-training point | seeds whose (a) reaches 95% |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        meta = {"command": benchlib.command_line(), "date": benchlib.now(),
                "machine": benchlib.machine()}  # fmt: skip
        benchlib.write_json(args.json, {"meta": meta, "results": results})


def _row(grid: str, reach: SameTrainingReach, seeds: int) -> str:
    point = ", ".join(f"{k}={v}" for k, v in reach.optimum.params.items())
    best = f"{point}: {reach.optimum.value:,.0f}"
    return f"| {grid} | {reach.sampler} | {best} | {reach.reached(FRACTION)}/{seeds} |"


def _record(reach: SameTrainingReach) -> dict:
    return {
        "search": reach.sampler,
        "budget": reach.budget,
        "optimum": {"params": reach.optimum.params, "value": reach.optimum.value},
        "found": reach.found,
        "reached_95": reach.reached(FRACTION),
    }


if __name__ == "__main__":
    main()
