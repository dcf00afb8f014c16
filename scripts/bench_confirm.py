"""The confirmation's estimator on real fresh-process pairs: bias and coverage against ground truth.

    python scripts/bench_confirm.py --pairs 20 --block 5 --json benchmarks/confirm_cpu.json
    python scripts/bench_confirm.py --pairs 20 --windows 80 --json benchmarks/confirm_inprocess_cpu.json

With `--windows N` the same comparisons are also measured as the confirmation's in-process mode
does (gpuopt.processes.shared_windows: both arms built once in one process, N rounds of alternating windows of
`--window-s`), cut into blocks of `--window-block` rounds (8: its first stage), each block one
confirmation, against the truth of the fresh-process pairs (`batch`) or 1.0 (`same`): the bias of
the in-process ratio against the fresh-process one, and the coverage of its intervals.

Two comparisons of known relation, each as `--pairs` interleaved fresh-process pairs in the
confirmation's order (A B, B A, ...; `python -m gpuopt.run`, the default sweep's window, the
confirmation's lean overrides):
  - same: the default config against itself (true ratio 1.0);
  - batch: batch 256 against batch 32 (true ratio: the estimate from all pairs).
Each comparison's pairs are cut into blocks of `--block` consecutive pairs (5: what the default
sweep's 10 confirmation runs give); every block is one confirmation, estimated as the sweeper does
(gpuopt.core.stats.speedup, Stein's interval with a first stage of 4 pairs). Reported: the
spread (sd) of the pairs' log-ratios, the pairs a +-10% interval needs at that spread, each block's
ratio and interval, the bias (mean block log-ratio - truth; meaningful for `same` only: for `batch`
the truth is the blocks' own mean) and the coverage (blocks whose interval holds the truth), and the
load average before every run. Blocks are few (20 pairs: 4): coverage
here is a check that the intervals are not far too narrow; tests/test_confirm.py measures it over
thousands of simulated confirmations.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from gpuopt.core.stats import mean_interval, speedup, stein_pairs
from gpuopt.sweeper.confirm.in_process import FIRST_STAGE_ROUNDS
from gpuopt.sweeper.confirm.schedule import LEAN_MEASURE

# The default sweep's window (conf/search/default.yaml) on the CPU, one compute thread.
WINDOW = [
    "device=cpu",
    "device.num_threads=1",
    "measure.warmup_steps=3",
    "measure.time_budget_s=2.0",
    "measure.min_time_s=1.0",
    *LEAN_MEASURE,
]
COMPARISONS = {
    "same": (["loader.batch_size=32"], ["loader.batch_size=32"], 1.0),
    "batch": (["loader.batch_size=32"], ["loader.batch_size=256"], None),
}


def measure_pairs(reference: list[str], candidate: list[str], pairs: int) -> dict[str, Any]:
    """`pairs` rounds of (reference, candidate) runs, the order reversed every other round."""
    arms = {"reference": [*WINDOW, *reference], "candidate": [*WINDOW, *candidate]}
    values: dict[str, list[float | None]] = {"reference": [], "candidate": []}
    loads: list[float] = []
    for r in range(pairs):
        for name in benchlib.round_order(list(arms), r):
            loads.append(os.getloadavg()[0])
            result = benchlib.run_fresh(arms[name])
            values[name].append(benchlib.throughput(result))
            print(
                f"  pair {r + 1}/{pairs} {name:<9} {benchlib.fmt(values[name][-1])} samples/s "
                f"(load {loads[-1]:.2f}, {result.get('wall_s', 0):.1f} s)",
                flush=True,
            )
    return {**values, "loads": loads}


def measure_windows(
    reference: list[str], candidate: list[str], rounds: int, window_s: float
) -> dict[str, Any]:
    """`rounds` rounds of (reference, candidate) windows in one shared process, as the
    confirmation's in-process mode measures them (its order, its windows)."""
    import tempfile

    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401 - registers the schemas
    from gpuopt.sweeper.shared_process import SharedProcess, write_config

    arms = {"reference": [*WINDOW, *reference], "candidate": [*WINDOW, *candidate]}
    directory = Path(tempfile.mkdtemp(prefix="bench_confirm_"))
    paths = {}
    for name, overrides in arms.items():
        with initialize_config_module(config_module="gpuopt.conf"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        paths[name] = write_config(cfg, directory, f"{name}.yaml")
    shared = SharedProcess.start(paths, {}, "throughput", window_s, directory)
    if shared.error:
        raise SystemExit(f"gpuopt.processes.shared_windows: {shared.error}")
    values: dict[str, list[float | None]] = {"reference": [], "candidate": []}
    loads: list[float] = []
    try:
        for r in range(rounds):
            for name in benchlib.round_order(list(arms), r):
                loads.append(os.getloadavg()[0])
                outcome = shared.window(name)
                values[name].append(outcome.values[0] if outcome.feasible else None)
            print(
                f"  round {r + 1}/{rounds}: candidate/reference "
                f"{benchlib.fmt(benchlib.ratio(values['candidate'][-1], values['reference'][-1]), 3)}",
                flush=True,
            )
    finally:
        shared.close()
    return {**values, "loads": loads}


def evaluate(
    data: dict[str, Any], truth: float | None, block: int, first_stage: int = 4
) -> dict[str, Any]:
    """The all-pairs estimate, then each block as one confirmation against the truth (Stein's
    interval with `first_stage` pairs: the fresh-process mode's 4, the in-process mode's 8)."""
    every = speedup(data["candidate"], data["reference"])
    truth = every.ratio if truth is None else truth
    d = [
        math.log(c / r)
        for c, r in zip(data["candidate"], data["reference"], strict=True)
        if c and r
    ]
    sd = mean_interval(d)[2]
    blocks = []
    for start in range(0, len(d) - block + 1, block):
        cand, ref = (
            data["candidate"][start : start + block],
            data["reference"][start : start + block],
        )
        s = speedup(cand, ref, first_stage=min(first_stage, block))
        blocks.append(
            {
                "ratio": s.ratio,
                "ci": [s.ci_low, s.ci_high],
                "halfwidth": s.halfwidth,
                "verdict": s.verdict,
                "covers": s.ci_low <= truth <= s.ci_high,
            }
        )
    return {
        "truth": truth,
        "all_pairs": {
            "ratio": every.ratio,
            "ci": [every.ci_low, every.ci_high],
            "halfwidth": every.halfwidth,
            "n_pairs": every.n_pairs,
        },
        "log_ratio_sd": sd,
        "pairs_for_10pct": stein_pairs(sd, first_stage, math.asinh(0.10)),
        "blocks": blocks,
        "bias_log": statistics.fmean(math.log(b["ratio"] / truth) for b in blocks)
        if blocks
        else None,
        "coverage": sum(b["covers"] for b in blocks) / len(blocks) if blocks else None,
        "load_1m": [min(data["loads"]), max(data["loads"])],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--block", type=int, default=5, help="pairs per simulated confirmation")
    parser.add_argument("--only", choices=sorted(COMPARISONS), nargs="*")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--windows", type=int, default=0, help="in-process rounds (0: none)")
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument("--window-block", type=int, default=FIRST_STAGE_ROUNDS)
    args = parser.parse_args()
    print(f"# {benchlib.command_line()}  ({benchlib.now()}, load {benchlib.load()})")
    print(f"# machine: {benchlib.machine()}")
    out: dict[str, Any] = {
        "command": benchlib.command_line(),
        "date": benchlib.now(),
        "machine": benchlib.machine(),
        "window": WINDOW,
    }
    for name in args.only or list(COMPARISONS):
        reference, candidate, truth = COMPARISONS[name]
        print(f"## {name}: {' '.join(candidate)} vs {' '.join(reference)}", flush=True)
        data = measure_pairs(reference, candidate, args.pairs)
        result = evaluate(data, truth, args.block)
        out[name] = {"data": data, **result}
        report(name, result, args.block)
        if args.windows:
            print(
                f"## {name}, in one process: {args.windows} rounds of {args.window_s:g} s windows"
            )
            windows = measure_windows(reference, candidate, args.windows, args.window_s)
            in_process = evaluate(windows, result["truth"], args.window_block, FIRST_STAGE_ROUNDS)
            out[f"{name}_in_process"] = {"data": windows, **in_process}
            report(f"{name} in-process", in_process, args.window_block)
    if args.json:
        benchlib.write_json(args.json, out)


def report(name: str, result: dict[str, Any], block: int) -> None:
    a = result["all_pairs"]
    print(
        f"{name}: all {a['n_pairs']} pairs {a['ratio']:.3f}x [95% CI {a['ci'][0]:.3f}-"
        f"{a['ci'][1]:.3f}, +-{100 * a['halfwidth']:.1f}%]; log-ratio sd "
        f"{100 * result['log_ratio_sd']:.1f}%, +-10% needs {result['pairs_for_10pct']} pairs; "
        f"blocks of {block}: bias {100 * (result['bias_log'] or 0):+.1f}% (log), "
        f"coverage {result['coverage']} of truth {result['truth']:.3f}; load "
        f"{result['load_1m'][0]:.2f}-{result['load_1m'][1]:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
