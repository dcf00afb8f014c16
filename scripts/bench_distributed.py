"""One process vs two ranks on this CPU: the same global batch trained by `distributed=none`, by
DDP and by FSDP2 over 2 gloo ranks (`distributed.nproc_per_node=2`), for `model=mlp` and
`model=transformer`, each in fresh `python -m gpuopt.run` processes, the arms interleaved.

    python scripts/bench_distributed.py --json benchmarks/distributed_cpu.json   # ~5 min, 2 cores
    python scripts/bench_distributed.py --quick                                  # smoke, ~2 min

Recorded per workload and arm (medians over `--repeats`): global throughput, step time (the
slowest rank's), the speedup over one process and the scaling efficiency (speedup / ranks), and
from the profiled window (`profile=on`, after the timed window) the communication share of the
step, exposed (the training thread waiting for a collective) and overlapped (a collective in
flight while it computed), the ranks' mean; each rank's row of the last repeat. The cores are
shared out between the ranks (one thread each on 2 cores), so on a CPU the ranks do not add
compute: against "1 process" (all the cores) two ranks show what the split costs, against
"1 process, a rank's cores" (the same batch on one rank's threads) what a second rank brings.
No loader work (`data.sample_cost=0`), no ceiling replay, no FLOP count, no numerics guard: the
step alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from gpuopt.core.host import usable_cpus

# (model overrides, global batch, FSDP2's shard_modules)
WORKLOADS: dict[str, tuple[list[str], int, str]] = {
    "mlp": (["model=mlp"], 256, "[]"),
    "transformer": (["model=transformer"], 32, "['*Block']"),
}
QUICK_MODELS = {
    "mlp": ["model.width=64", "model.depth=1"],
    "transformer": ["model.width=32", "model.depth=1", "model.input_shape=[32]"],
}
COMMON = [
    "device=cpu",
    "precision=fp32",
    "data.sample_cost=0",
    "guard.enabled=false",
    "profile=on",
    *benchlib.LEAN_MEASURE,
]
WINDOW = ["measure.time_budget_s=3", "measure.min_time_s=1.5", "profile.steps=5"]
QUICK_WINDOW = [
    "measure.warmup_steps=1",
    "measure.time_budget_s=0.5",
    "measure.min_steps=3",
    "measure.max_steps=8",
    "profile.steps=2",
]
METRICS = (
    "throughput",
    "step_time_ms",
    "comm_share",
    "comm_exposed",
    "comm_overlapped",
    "timed_steps",
)


def arms(workload: str, quick: bool) -> dict[str, list[str]]:
    """The three ways to train the workload's global batch."""
    model, global_batch, shard = WORKLOADS[workload]
    base = [*COMMON, *model, *(QUICK_MODELS[workload] if quick else [])]
    base += QUICK_WINDOW if quick else WINDOW
    ranks = ["distributed.nproc_per_node=2", f"loader.batch_size={global_batch // 2}"]
    ranks.append(f"train.global_batch={global_batch}")
    share = f"device.num_threads={max(1, usable_cpus() // 2)}"  # what each rank gets
    return {
        "1 process": [*base, f"loader.batch_size={global_batch}"],
        "1 process, a rank's cores": [*base, f"loader.batch_size={global_batch}", share],
        "ddp x2": [*base, "distributed=ddp", *ranks],
        "fsdp2 x2": [*base, "distributed=fsdp2", *ranks, f"distributed.shard_modules={shard}"],
    }


def median(results: list[dict[str, Any]], name: str) -> float | None:
    values = [
        v for r in results if r.get("status") == "ok" and (v := r["metrics"].get(name)) is not None
    ]
    return statistics.median(values) if values else None


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    single = median(runs["1 process"], "throughput")
    one_rank = median(runs["1 process, a rank's cores"], "throughput")
    summary: dict[str, Any] = {}
    for arm, results in runs.items():
        row: dict[str, Any] = {name: median(results, name) for name in METRICS}
        world = 2 if "x2" in arm else 1
        row["speedup"] = benchlib.ratio(row["throughput"], single)
        row["scaling_efficiency"] = row["speedup"] / world if row["speedup"] else None
        row["speedup_over_a_ranks_cores"] = benchlib.ratio(row["throughput"], one_rank)
        row["statuses"] = [r.get("status") for r in results]
        row["reasons"] = [r.get("reason") for r in results if r.get("status") != "ok"]
        last = results[-1]
        row["ranks"] = last.get("ranks")
        comm = (last.get("profile") or {}).get("comm")
        row["rank0_comm"] = comm  # seconds per step by collective, from rank 0's trace
        summary[arm] = row
    return summary


def line(workload: str, arm: str, row: dict[str, Any]) -> str:
    f = benchlib.fmt
    return (
        f"{workload:12s} {arm:26s} {f(row['throughput'])} samples/s  step "
        f"{f(row['step_time_ms'], 2)} ms  x{f(row['speedup'], 2)}  comm {f(row['comm_share'])}% "
        f"(exposed {f(row['comm_exposed'])}%, overlapped {f(row['comm_overlapped'])}%)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="tiny models and windows, 1 repeat")
    parser.add_argument("--json", help="write the results here (e.g. benchmarks/...json)")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    out: dict[str, Any] = {
        "command": benchlib.command_line(),
        "date": benchlib.now(),
        "machine": benchlib.machine(),
        "load_before": benchlib.load(),
        "common": COMMON,
        "workloads": {},
    }
    for workload in args.workloads:
        configured = arms(workload, args.quick)
        runs = benchlib.interleave(
            configured, repeats, log=lambda text: print(text, file=sys.stderr)
        )
        summary = summarize(runs)
        out["workloads"][workload] = {"arms": configured, "summary": summary}
        for arm, row in summary.items():
            print(line(workload, arm, row), flush=True)
    out["load_after"] = benchlib.load()
    if args.json:
        benchlib.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
