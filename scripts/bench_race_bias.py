"""The race's bias: one pair of configurations, its speedup read three ways.

    python scripts/bench_race_bias.py --pairs 6 --rounds 12 --json benchmarks/race_bias_cpu.json

The pair: the default config (batch 32, no workers, fp32) against `--candidate` (default: the
mlp default sweep's answer on a CPU with native bf16, batch 512, 2 workers, bf16, 1 thread), both
with the default sweep's fixed measure settings. Read as
  1. fresh: `--pairs` fresh-process pairs (`python -m gpuopt.run`, A B / B A): the ground truth a
     fresh-process sweep would give;
  2. shared: a new shared process (gpuopt.processes.shared_windows), `--rounds` rounds of alternating
     `--window-s` windows (the in-process confirmation, nothing run before it);
  3. race: the same, in a process that first ran both as whole trials with the profiler on (what
     the race's process has done before its confirmation).
Each as the paired speedup with its 95% interval (gpuopt.core.stats.speedup); the bias of 2 and 3
against 1 is their log-ratio.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from gpuopt.core.stats import speedup
from gpuopt.sweeper.shared_process import SharedProcess

WINDOW = [
    "device=cpu",
    "measure.warmup_steps=3",
    "measure.time_budget_s=2.0",
    "measure.min_time_s=1.0",
    "measure.ceiling_steps=10",
]
BASE = ["loader.batch_size=32", "loader.num_workers=0", "precision=fp32"]
CANDIDATE = [
    "loader.batch_size=512",
    "loader.num_workers=2",
    "precision=bf16",
    "device.num_threads=1",
]


def as_text(s: Any) -> dict[str, Any]:
    return {
        "speedup": s.ratio,
        "ci": [s.ci_low, s.ci_high],
        "pairs": s.n_pairs,
        "text": f"{s.ratio:.3f}x [{s.ci_low:.3f}-{s.ci_high:.3f}], {s.n_pairs} pairs",
    }


def fresh(pairs: int, candidate: list[str]) -> dict[str, Any]:
    arms = {"base": [*WINDOW, *BASE], "cand": [*WINDOW, *candidate]}
    results = benchlib.interleave(arms, pairs, log=lambda line: print(line, file=sys.stderr))
    values = {k: [benchlib.throughput(r) for r in v] for k, v in results.items()}
    return as_text(speedup(values["cand"], values["base"]))


def configs(folder: Path, candidate: list[str], profile: bool) -> dict[str, Path]:
    extra, tag = (["profile=on"], "-profiled") if profile else ([], "")
    arms = {"base": [*WINDOW, *BASE, *extra], "cand": [*WINDOW, *candidate, *extra]}
    paths = benchlib.composed_configs(folder / f"configs{tag}", arms)
    return paths


def shared(rounds: int, window_s: float, candidate: list[str], whole_first: bool) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="gpuopt-race-bias-"))
    race = SharedProcess.open(folder, "throughput", window_s)
    try:
        if whole_first:
            for label, path in configs(folder, candidate, profile=True).items():
                assert race.whole_trial(label, path, folder / label) is not None, race.error
        for label, path in configs(folder, candidate, profile=False).items():
            assert race.add(label, path).status == "ok", race.error
        values: dict[str, list[float]] = {"base": [], "cand": []}
        for r in range(rounds):
            for label in ["base", "cand"] if r % 2 == 0 else ["cand", "base"]:
                values[label].append(race.measure(label, window_s, 3).throughput)
    finally:
        race.close()
    return as_text(speedup(values["cand"], values["base"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--window-s", type=float, default=0.5)
    parser.add_argument("--candidate", nargs="+", default=CANDIDATE)
    parser.add_argument("--json")
    args = parser.parse_args()
    out = {"load_before": benchlib.load(), "date": benchlib.now()}
    out["shared"] = shared(args.rounds, args.window_s, args.candidate, whole_first=False)
    out["race"] = shared(args.rounds, args.window_s, args.candidate, whole_first=True)
    out["fresh"] = fresh(args.pairs, args.candidate)
    truth = out["fresh"]["speedup"]
    for way in ("shared", "race"):
        out[way]["bias_vs_fresh"] = math.exp(math.log(out[way]["speedup"] / truth)) - 1.0
    for way in ("fresh", "shared", "race"):
        bias = out[way].get("bias_vs_fresh")
        print(
            f"{way}: {out[way]['text']}"
            + (f", {100 * bias:+.1f}% vs fresh" if bias is not None else "")
        )
    if args.json:
        benchlib.write_json(
            args.json, {"machine": benchlib.machine(), "command": benchlib.command_line(), **out}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
