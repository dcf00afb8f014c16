"""Native vs Lightning engine: the same model/data/precision/batch measured by both, side by side.

Each measurement is a fresh `python -m gpuopt.run` process (trials in a long-lived process read
10-35% faster on a 2-core machine), and the two engines alternate within each repeat (native, lightning,
then lightning, native, ...) so drift of the machine hits both alike. Reported per workload: the
median of each engine's metrics, and the median and range of the per-repeat ratio lightning/native.

    python scripts/bench_engines.py                 # 5 repeats of each workload, ~8 min on 2 cores
    python scripts/bench_engines.py --repeats 3 --workloads mlp --json out.json

The ratio is Lightning's overhead on this configuration (its loop, hooks and progress tracking per
step): a finding, not a bug. startup_time_s shows the cost of importing Lightning in a fresh process.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# CPU workloads: one input-bound (the MLP, with per-sample decode work and loader workers) and one
# compute-bound (a small CNN, no per-sample work).
WORKLOADS: dict[str, list[str]] = {
    "mlp": ["model=mlp", "loader.batch_size=256", "loader.num_workers=1", "device.num_threads=1"],
    "cnn": [
        "model=cnn",
        "model.width=16",
        "model.depth=1",
        "loader.batch_size=64",
        "data.sample_cost=0",
    ],
}
COMMON = ["device=cpu", "precision=fp32", "measure.time_budget_s=4", "measure.ceiling_steps=10"]
METRICS = (
    "throughput",
    "step_time_ms",
    "data_wait",
    "ceiling_throughput",
    "startup_time_s",
    "timed_steps",
)


def measure_once(engine: str, overrides: list[str], workdir: Path) -> dict[str, Any]:
    """One fresh process; returns its result.json (status, metrics)."""
    out = Path(tempfile.mkdtemp(prefix=f"{engine}-", dir=workdir))
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(out)}
    cmd = [sys.executable, "-m", "gpuopt.run", f"engine={engine}", *COMMON, *overrides]
    done = subprocess.run(
        cmd, check=False, env=env, capture_output=True, text=True, timeout=600, cwd=workdir
    )
    files = list(out.rglob("result.json"))
    if done.returncode != 0 or not files:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(files[0].read_text())


def loop_overhead(steps: int = 300, repeats: int = 3) -> dict[str, list[float]]:
    """Median step time (ms) of a trivial model (Linear(4, 2), batch 8, one thread) in a plain
    PyTorch loop vs lightning.Trainer: what Lightning's loop itself costs per step. Both run in this
    one (warm) process, interleaved; steps 50+ only."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    import lightning.pytorch as pl

    from gpuopt.engines.lightning.engine import _RepeatedBatch

    torch.set_num_threads(1)
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))

    def median_step_ms(stamps: list[float]) -> float:
        return 1e3 * statistics.median(b - a for a, b in itertools.pairwise(stamps[50:]))

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(self.layer(b[0]), b[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Stamps(pl.Callback):
        def __init__(self) -> None:
            self.t: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.t.append(time.perf_counter())

    def plain() -> float:
        layer = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        stamps = []
        for _ in range(steps):
            torch.nn.functional.cross_entropy(layer(batch[0]), batch[1]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stamps.append(time.perf_counter())
        return median_step_ms(stamps)

    def lightning() -> float:
        stamps = Stamps()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[stamps],
        )  # fmt: skip
        trainer.fit(Tiny(), train_dataloaders=_RepeatedBatch(batch, steps))
        return median_step_ms(stamps.t)

    result: dict[str, list[float]] = {"plain_ms": [], "lightning_ms": []}
    for _ in range(repeats):
        result["plain_ms"].append(plain())
        result["lightning_ms"].append(lightning())
    return result


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for engine, results in runs.items():
        summary[engine] = {
            name: statistics.median(
                r["metrics"][name] for r in results if r["metrics"].get(name) is not None
            )
            for name in METRICS
            if any(r["metrics"].get(name) is not None for r in results)
        }
    ratios = [
        lt["metrics"]["throughput"] / nt["metrics"]["throughput"]
        for nt, lt in zip(runs["native"], runs["lightning"], strict=False)
    ]
    summary["ratio_lightning_over_native"] = {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "per_repeat": ratios,
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--no-overhead", action="store_true", help="skip the per-step loop overhead"
    )
    parser.add_argument("--json", type=Path, help="write the raw results and the summary here")
    args = parser.parse_args(argv)

    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "load_before": os.getloadavg(),
        "common": COMMON,
        "workloads": {},
    }
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        for workload in args.workloads:
            overrides = WORKLOADS[workload]
            runs: dict[str, list[dict[str, Any]]] = {"native": [], "lightning": []}
            for repeat in range(args.repeats):
                order = ("native", "lightning") if repeat % 2 == 0 else ("lightning", "native")
                for engine in order:
                    result = measure_once(engine, overrides, Path(tmp))
                    if result["status"] != "ok":
                        raise RuntimeError(
                            f"{workload}/{engine}: {result['status']} {result.get('reason')}"
                        )
                    runs[engine].append(result)
                    m = result["metrics"]
                    print(
                        f"{workload:4s} #{repeat} {engine:9s} {m['throughput']:9.1f} samples/s  "
                        f"step {m['step_time_ms']:7.2f} ms  wait {m['data_wait']:5.1f}%  "
                        f"startup {m['startup_time_s']:5.1f} s",
                        flush=True,
                    )
            report["workloads"][workload] = {
                "overrides": overrides,
                "summary": summarize(runs),
                "raw": {e: [r["metrics"] for r in rs] for e, rs in runs.items()},
            }
    if not args.no_overhead:
        report["loop_overhead"] = loop_overhead()
    report["load_after"] = os.getloadavg()
    report["wall_s"] = time.time() - started

    print(
        f"\n{report['date']}  {report['machine']}\n`{report['command']}` ({report['wall_s']:.0f} s)"
    )
    print(
        "| workload | engine | throughput (samples/s) | step (ms) | data wait (%) | ceiling (samples/s) | startup (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for workload, data in report["workloads"].items():
        for engine in ("native", "lightning"):
            s = data["summary"][engine]
            print(
                f"| {workload} | {engine} | {s['throughput']:.1f} | {s['step_time_ms']:.2f} | "
                f"{s['data_wait']:.1f} | {s.get('ceiling_throughput', float('nan')):.1f} | {s['startup_time_s']:.1f} |"
            )
    for workload, data in report["workloads"].items():
        r = data["summary"]["ratio_lightning_over_native"]
        print(
            f"{workload}: lightning/native throughput ratio median {r['median']:.3f} (range {r['min']:.3f}-{r['max']:.3f})"
        )
    if "loop_overhead" in report:
        o = report["loop_overhead"]
        print(
            f"per-step loop cost, trivial model: plain {statistics.median(o['plain_ms']):.3f} ms, "
            f"lightning {statistics.median(o['lightning_ms']):.3f} ms (medians of {o})"
        )
    print(f"load average before {report['load_before']}, after {report['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
