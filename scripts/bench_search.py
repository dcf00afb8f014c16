"""Search efficiency: trials each sampler needs to reach 95% / 99% of a measured grid's optimum.

    python scripts/bench_search.py                       # shipped grid, 10 seeds (~1-3 min)
    python scripts/bench_search.py --seeds 20 --json out.json

Replays benchmarks/grid_cpu.json (measured once with the real engine by scripts/measure_grid.py)
as a lookup-table objective (scripts/replay.py): every sampler asks through Optuna exactly as the sweeper
does, the grid answers with the measured throughput. Contenders:

- random, tpe, gp, nsgaii: Optuna's samplers with library defaults, single objective (throughput);
- gpuopt default: what `python -m gpuopt.run -m` does, read from the composed config: its sampler,
  its objectives (throughput + utilization), the baseline trial first, device-aware trimming;
- gpuopt sampler only: the same sampler set up like the Optuna rows (one objective, full space);
- with --variant: gpuopt's default with some sweeper settings changed (which setting helps?).

The last column: seeds that reach 95% within the default preset's own n_trials (a default sweep's
whole budget).

Counts are median over seeds; a seed that never reaches the target within the budget (default: the
grid's size) counts as worse than any budget, and a median that is such a seed prints as "> budget".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib
from replay import (
    DEFAULT_GRID_PATH,
    Contender,
    Grid,
    SamplerSummary,
    compare_samplers,
    gpuopt_contenders,
    optuna_contenders,
    sweeper_defaults,
)

TARGET_FRACTION = 0.95
TARGET_SHARE = (
    0.20  # the goal: the default reaches 95% of the optimum within 20% of the grid's trials
)


def _cell(summary: SamplerSummary, fraction: float, n: int) -> str:
    median = summary.median(fraction)
    if median is None:
        return f"> {summary.budget}"
    return f"{median:g} ({100 * median / n:.0f}%)"


def table(
    grid: Grid,
    summaries: list[SamplerSummary],
    fractions: tuple[float, ...],
    seconds: dict[str, float],
    preset_trials: int,
) -> str:
    n = len(grid.points)
    head = "| sampler | " + " | ".join(
        f"median trials to {f:.0%} (share of grid)" for f in fractions
    )
    head += " | seeds reaching " + " / ".join(f"{f:.0%}" for f in fractions)
    head += f" | seeds reaching 95% within {preset_trials} trials | replay s |"
    lines = [head, "|" + "---|" * (len(fractions) + 4)]
    for s in summaries:
        cells = [_cell(s, f, n) for f in fractions]
        reached = " / ".join(f"{s.reached(f)}/{len(s.reach[f])}" for f in fractions)
        early = f"{s.reached(0.95, within=preset_trials)}/{len(s.reach[0.95])}"
        lines.append(
            f"| {s.sampler} | "
            + " | ".join(cells)
            + f" | {reached} | {early} | {seconds[s.sampler]:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--grid", type=Path, default=DEFAULT_GRID_PATH)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument(
        "--budget", type=int, default=None, help="trials per search (default: the grid's size)"
    )
    parser.add_argument("--samplers", nargs="*", default=None, help="subset of contender names")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="OVERRIDES",
        help="also replay gpuopt's default with these sweeper overrides (space-separated), "
        "e.g. 'hydra.sweeper.sampler.multivariate=true'; repeatable",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the per-seed counts here"
    )
    args = parser.parse_args()

    grid = Grid.load(args.grid)
    n = len(grid.points)
    best = grid.best()
    fractions = (0.95, 0.99)
    # Composed once, at the start: the sweeper's defaults as they are when the replay begins.
    defaults = sweeper_defaults(grid.meta.get("fixed_overrides", ()))
    contenders: list[Contender] = gpuopt_contenders(grid, defaults=defaults) + optuna_contenders()
    for variant in args.variant:
        contenders += gpuopt_contenders(grid, variant.split())
    default = contenders[0].setup  # gpuopt's default, for the header (before --samplers filters)
    if args.samplers:
        contenders = [c for c in contenders if c.name in args.samplers]
    print(
        f"grid {args.grid} : {n} configurations, optimum {best.value:,.1f} samples/s at {best.params}"
    )
    print(
        f"  95% target {grid.target(0.95):,.1f} ({grid.rank_of(grid.target(0.95))} configs reach it), "
        f"99% target {grid.target(0.99):,.1f} ({grid.rank_of(grid.target(0.99))} configs)"
    )
    print(f"  gpuopt default: sampler {dict(defaults.sampler)}, n_trials {defaults.n_trials}")
    print(
        f"  gpuopt default: objectives {default.objectives or (grid.objective,)}, baseline {default.enqueue}, "
        f"space {default.space or grid.space}"
    )
    print(f"  {args.seeds} seeds, budget {args.budget or n} trials; load {benchlib.load()}")

    seconds: dict[str, float] = {}
    summaries = []
    for contender in contenders:
        t0 = time.perf_counter()
        summaries += compare_samplers(
            grid, [contender], range(args.seeds), budget=args.budget, fractions=fractions
        )
        seconds[contender.name] = time.perf_counter() - t0
        print(f"  {contender.name}: {seconds[contender.name]:.1f} s", flush=True)

    print()
    preset_trials = defaults.n_trials
    print(table(grid, summaries, fractions, seconds, preset_trials))
    goal = TARGET_SHARE * n
    default_median = (
        summaries[0].median(TARGET_FRACTION) if summaries[0].sampler == "gpuopt default" else None
    )
    if default_median is not None or summaries[0].sampler == "gpuopt default":
        verdict = "MET" if default_median is not None and default_median <= goal else "MISSED"
        print(
            f"\ntarget: gpuopt default reaches {TARGET_FRACTION:.0%} of the optimum within "
            f"{TARGET_SHARE:.0%} of the grid ({goal:g} trials), median: {default_median} -> {verdict}"
        )
    if args.json:
        benchlib.write_json(
            args.json,
            {
                "grid": str(args.grid),
                "command": benchlib.command_line(),
                "date": benchlib.now(),
                "seeds": args.seeds,
                "budget": args.budget or n,
                "results": [
                    {
                        "sampler": s.sampler,
                        "reach": {str(f): s.reach[f] for f in fractions},
                        "median": {str(f): s.median(f) for f in fractions},
                    }
                    for s in summaries
                ],
            },
        )


if __name__ == "__main__":
    main()
