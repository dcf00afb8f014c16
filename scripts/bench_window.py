"""gpuopt's timed window versus a plain loop, alternating in one process (agreement without the
process-to-process noise).

    python scripts/bench_window.py --rounds 20                     # the default config
    python scripts/bench_window.py --rounds 20 loader.batch_size=512 loader.num_workers=2 \\
        device.num_threads=1                                        # the default sweep's best

scripts/bench_agreement.py compares the two in fresh processes, where one process's throughput
spreads 6-14% on a 2-core VM and five rounds cannot resolve 3%. Here both are built once in one
process - gpuopt's side as the confirmation's in-process mode builds a trial
(gpuopt.trial.interleave.build_member: the native engine's model, DataLoader and step), the plain loop's
side as bench_agreement.py builds it (hydra.utils.instantiate, its own DataLoader and step) - and
measured in turns, A B B A: gpuopt's real timed window (`measure_timed_window`: its clock, its
stability stop, its sample count) against `--steps` plain steps between two perf_counter reads.
Before each turn the idle side's prefetched batches are drained untimed. The paired log-ratio
estimator is the confirmation's (gpuopt.core.stats.speedup). What this cannot see is a
fresh process's own start-up effects; bench_agreement.py and bench_noise.py measure those.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_agreement
import benchlib

from gpuopt.core.stats import speedup

BASE = ["device=cpu", "device.num_threads=1", "measure.warmup_steps=3"]


def build_gpuopt(overrides: list[str], directory: Path) -> Any:
    """gpuopt's trial, as the in-process confirmation builds it."""
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401 - registers the schemas
    from gpuopt.sweeper.memory_axis import write_probe_config
    from gpuopt.trial.interleave import build_member

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    member = build_member("gpuopt", str(write_probe_config(cfg, directory, "gpuopt.yaml")), {})
    if member.failure:
        raise SystemExit(f"gpuopt's trial failed to build: {member.failure}")
    return member


def gpuopt_window(member: Any) -> float:
    """One real timed window of gpuopt's native engine (its stop rule ends it): samples/s."""
    from gpuopt.engines._build import apply_policies
    from gpuopt.engines.native import timed_window
    from gpuopt.trial.memory import MemoryBaseline

    trial, workload, feed = member.built.trial, member.built.workload, member.built.feed
    apply_policies(trial.spec, trial.device)
    for _ in range(member.built.queued_steps()):
        workload.train_step(feed.next_step())
    memory = MemoryBaseline.take(trial.device)
    timed_window(trial, workload, feed, member.built.cache, memory, time.time())
    return float(trial.metrics.throughput)


def build_plain(overrides: list[str]) -> Any:
    """The plain loop's model, loader and step (bench_agreement.py's own building)."""
    import torch
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module(config_module="gpuopt.conf"):
        conf = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    device = torch.device("cpu")
    bench_agreement._apply_flags(conf)
    model, loader, optimizer = bench_agreement._build(conf, device)
    step = bench_agreement._make_step(conf, model, optimizer, device)

    def batches():
        while True:
            yield from loader

    return conf, step, batches()


def plain_window(plain: Any, steps: int) -> float:
    conf, step, batches = plain
    loader = conf["loader"]
    prefetched = loader["num_workers"] * (loader.get("prefetch_factor") or 2)
    bench_agreement._apply_flags(conf)
    for _ in range(prefetched + 1):  # the idle turn's queue, drained untimed
        step(*next(batches))
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*next(batches))
    return steps * loader["batch_size"] / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60, help="plain loop steps per turn")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [*BASE, *args.overrides]
    print(f"# {benchlib.command_line()}  ({benchlib.now()}, load {benchlib.load()})", flush=True)
    member = build_gpuopt(overrides, Path(tempfile.mkdtemp(prefix="bench_window_")))
    plain = build_plain(overrides)
    values: dict[str, list[float]] = {"gpuopt": [], "plain": []}
    for r in range(args.rounds):
        for name in benchlib.round_order(list(values), r):
            value = gpuopt_window(member) if name == "gpuopt" else plain_window(plain, args.steps)
            values[name].append(value)
        print(
            f"  round {r + 1}/{args.rounds}: gpuopt {benchlib.fmt(values['gpuopt'][-1])} "
            f"plain {benchlib.fmt(values['plain'][-1])} samples/s",
            flush=True,
        )
    s = speedup(values["gpuopt"], values["plain"])
    within = s.ci_low >= 0.97 and s.ci_high <= 1.03
    print(
        f"gpuopt / plain loop, {s.n_pairs} pairs in one process: {s.ratio:.4f} "
        f"[95% CI {s.ci_low:.4f}-{s.ci_high:.4f}] = {100 * (s.ratio - 1):+.1f}% "
        f"(log-ratio sd {100 * (s.log_sd or 0):.1f}%); goal within 3%: "
        f"{'met' if within else 'not shown'}",
        flush=True,
    )
    if args.json:
        benchlib.write_json(
            args.json,
            {
                "command": benchlib.command_line(),
                "date": benchlib.now(),
                "machine": benchlib.machine(),
                "overrides": overrides,
                **values,
                "ratio": s.ratio,
                "ci": [s.ci_low, s.ci_high],
                "log_sd": s.log_sd,
                "within_3pct": within,
            },
        )


if __name__ == "__main__":
    main()
