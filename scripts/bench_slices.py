"""How close in time two windows must be to share the machine's speed, and whether a build has a
speed of its own: the evidence behind the race's sliced screen (gpuopt/sweeper/comparison.py).

    python scripts/bench_slices.py --json benchmarks/slices_epyc.json

Three measurements of gpuopt's default mlp (256 -> 3 x 512 -> 10, AdamW, batch 32, the CPU's
threads) in one process:
- drift: back-to-back windows of one build; each window's rate and its 10th-percentile step
  over their medians, with the CPU steal in each (a window's speed moving with no steal is the
  machine, not the hypervisor's other guests);
- slices: two identical builds A and B, each read for `--arm-s` seconds per comparison in
  slices of S seconds alternated A B B A ...; the log-sd of B/A over the comparisons, per S
  (1 s of an arm as one window each against the same time cut in 0.1 s slices);
- builds: K builds alive at once, read in rotation; each build's median ratio to its round's
  median (a build whose tensors' place in memory sets its speed reads apart in every round).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

BATCH, FEATURES, WIDTH, CLASSES = 32, 256, 512, 10


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    width = FEATURES
    for _ in range(3):
        layers += [torch.nn.Linear(width, WIDTH), torch.nn.ReLU()]
        width = WIDTH
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, CLASSES))
    return model, torch.optim.AdamW(model.parameters())


GEN = torch.Generator().manual_seed(1)
BATCHES = [
    (
        torch.randn(BATCH, FEATURES, generator=GEN),
        torch.randint(0, CLASSES, (BATCH,), generator=GEN),
    )
    for _ in range(64)
]


def window(arm: tuple[torch.nn.Module, torch.optim.Optimizer], seconds: float) -> list[float]:
    """Optimizer steps for `seconds`; each step's seconds."""
    model, optimizer = arm
    steps: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        t0 = time.perf_counter()
        x, y = BATCHES[len(steps) % len(BATCHES)]
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps.append(time.perf_counter() - t0)
    return steps


def steal_ticks() -> tuple[int, int]:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return int(fields[7]), sum(map(int, fields))


def drift(windows: int, seconds: float) -> dict[str, Any]:
    arm = build(0)
    window(arm, 0.5)
    rates, p10s, steal = [], [], []
    for _ in range(windows):
        before = steal_ticks()
        steps = window(arm, seconds)
        after = steal_ticks()
        rates.append(len(steps) / sum(steps))
        p10s.append(1.0 / sorted(steps)[len(steps) // 10])
        steal.append(100.0 * (after[0] - before[0]) / max(1, after[1] - before[1]))
    rate_m, p10_m = statistics.median(rates), statistics.median(p10s)
    return {
        "window_s": seconds,
        "rate_over_median": [round(r / rate_m, 3) for r in rates],
        "p10_step_over_median": [round(r / p10_m, 3) for r in p10s],
        "steal_pct": [round(s, 1) for s in steal],
    }


def slices(slice_lengths: list[float], comparisons: int, arm_s: float) -> dict[str, Any]:
    a, b = build(0), build(1)
    window(a, 0.5)
    window(b, 0.5)
    out = {}
    for length in slice_lengths:
        ratios = []
        for _ in range(comparisons):
            seconds = {"a": [0, 0.0], "b": [0, 0.0]}
            for i in range(max(1, round(arm_s / length))):
                for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
                    steps = window(a if name == "a" else b, length)
                    seconds[name][0] += len(steps)
                    seconds[name][1] += sum(steps)
            ratios.append((seconds["b"][0] / seconds["b"][1]) / (seconds["a"][0] / seconds["a"][1]))
        logs = [math.log(r) for r in ratios]
        out[f"{length:g}"] = {
            "log_sd": round(statistics.pstdev(logs), 4),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        }
    return out


def builds(k: int, rounds: int, seconds: float) -> dict[str, Any]:
    alive = [build(i) for i in range(k)]
    for arm in alive:
        window(arm, 0.3)
    relative: list[list[float]] = [[] for _ in alive]
    round_medians = []
    for r in range(rounds):
        order = range(k) if r % 2 == 0 else reversed(range(k))
        rates = {i: len(s) / sum(s) for i in order for s in [window(alive[i], seconds)]}
        median = statistics.median(rates.values())
        round_medians.append(round(median, 1))
        for i, rate in rates.items():
            relative[i].append(rate / median)
    return {
        "round_medians_steps_per_s": round_medians,
        "build_median_over_round": [round(statistics.median(r), 3) for r in relative],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--slices", type=float, nargs="+", default=[1.0, 0.25, 0.1, 0.05])
    parser.add_argument("--comparisons", type=int, default=12)
    parser.add_argument("--arm-s", type=float, default=1.0)
    parser.add_argument("--builds", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    out: dict[str, Any] = {"date": benchlib.now(), "load_before": benchlib.load()}
    out["drift"] = drift(args.windows, 0.8)
    print("drift", out["drift"], flush=True)
    out["slices"] = slices(args.slices, args.comparisons, args.arm_s)
    print("slices", out["slices"], flush=True)
    out["builds"] = builds(args.builds, args.rounds, 0.5)
    print("builds", out["builds"], flush=True)
    if args.json:
        out.update(machine=benchlib.machine(), command=benchlib.command_line())
        benchlib.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
