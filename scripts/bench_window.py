"""gpuopt's timed window versus a plain loop, alternating in one process (agreement without the
process-to-process noise).

    python scripts/bench_window.py --rounds 20                     # the default config
    python scripts/bench_window.py --rounds 20 loader.batch_size=512 loader.num_workers=2 \\
        device.num_threads=1                                        # the default sweep's best
    python scripts/bench_window.py --own-cost --rounds 30 --steps 500   # the window's own cost

scripts/bench_agreement.py compares the two in fresh processes, where one process's throughput
spreads 6-14% on a 2-core VM and five rounds cannot resolve 3%. Here both are built once in one
process - gpuopt's side as the confirmation's in-process mode builds a trial
(gpuopt.processes.shared_windows.build_member: the native engine's model, DataLoader and step), the plain loop's
side as bench_agreement.py builds it (hydra.utils.instantiate, its own DataLoader and step) - and
measured in turns, A B B A: gpuopt's real timed window (the window meter: its clock, its
stability stop, its sample count) against `--steps` plain steps between two perf_counter reads.
Before each turn the idle side's prefetched batches are drained untimed. The paired log-ratio
estimator is the confirmation's (gpuopt.core.stats.speedup). What this cannot see is a
fresh process's own start-up effects; bench_agreement.py and bench_noise.py measure those.

`--own-cost` measures what the comparison above cannot resolve on a shared 2-core VM (its pairs
spread 5-10%): the window's own bookkeeping per step, timed alone (`own_cost`), as a share of the
configuration's step.
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
    from gpuopt.core.shared_protocol import Steady
    from gpuopt.processes.shared_windows import build_member
    from gpuopt.sweeper.shared_process import write_config

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    member = build_member("gpuopt", str(write_config(cfg, directory, "gpuopt.yaml")), Steady())
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
    first_step = feed.next_step()
    timed_window(trial, workload, feed, first_step, member.built.cache, memory, time.time())
    return float(trial.metrics.throughput)


def build_plain(overrides: list[str], shared: Any = None) -> Any:
    """The plain loop's model, loader and step (bench_agreement.py's own building); with `shared`
    (gpuopt's member) its step trains gpuopt's own model and optimizer on batches from gpuopt's
    own DataLoader (a second iterator over it): what differs is then the window alone."""
    import torch
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module(config_module="gpuopt.conf"):
        conf = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    device = torch.device("cpu")
    bench_agreement._apply_flags(conf)
    if shared is not None:
        workload = shared.built.workload
        model, loader, optimizer = workload.model, shared.built.feed.loader, workload.optimizer
    else:
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


def own_cost(member: Any, rounds: int, steps: int) -> dict[str, Any]:
    """The window's own cost per step, timed alone: the window meter over a step that trains nothing
    but does the window's per-step bookkeeping (the BatchFeed over ready host batches: its timers,
    sample count and move; the step's loss watch; the cache policy), with the trial's clock and a
    stop rule whose CI every read computes (min_time_s 0, a target never met), `steps` steps a
    round. What a step of this configuration costs is the real windows' median step time. Timed
    alone, since a window-vs-plain-loop difference of 0.5% is below what pairs of 60-step turns
    resolve on a shared 2-core VM (their spread: ~1% per pair)."""
    import dataclasses
    import itertools
    import math
    import statistics

    import torch

    from gpuopt.engines._batches import BatchFeed
    from gpuopt.engines._meter import WindowMeter
    from gpuopt.trial.context import Trial
    from gpuopt.trial.measure import StopRule

    built = member.built
    trial, workload = built.trial, built.workload
    ready = list(itertools.islice(iter(built.feed.loader), 8))
    loss = torch.zeros((), device=trial.device)
    # The loss watch; code from before it (a per-step NonFiniteLoss.update) is measured alike.
    watch = getattr(workload, "_watch_loss", workload.nonfinite.update)
    rule = StopRule(trial.spec.measure.min_steps, steps, math.inf, 0.0)
    no_warmup = dataclasses.replace(trial.spec.measure, warmup_steps=0)

    def bookkeeping() -> float:
        feed = BatchFeed(ready, workload.to_device, trial.device)

        def step() -> int:
            before = feed.samples
            feed.next_step()
            watch(loss)
            return feed.samples - before

        windowed = Trial(dataclasses.replace(trial.spec, measure=no_warmup), trial.device)
        meter = WindowMeter(
            windowed, wait=feed.wait, after_step=built.cache.after_step, count_flops=False
        )
        meter.rule = rule
        t0 = time.perf_counter()
        meter.run(step)
        return (time.perf_counter() - t0) / steps

    step_ms = []
    for _ in range(3):
        gpuopt_window(member)
        step_ms.append(trial.metrics.step_time_ms)
    own_us = [1e6 * bookkeeping() for _ in range(rounds)]
    step_us = 1e3 * statistics.median(step_ms)
    median = statistics.median(own_us)
    return {
        "own_us": own_us,
        "own_median_us": median,
        "step_us": step_us,
        "share": median / step_us,
    }


def report_own_cost(cost: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"the window's own cost: {cost['own_median_us']:.1f} us/step (median of {args.rounds} "
        f"rounds of {args.steps} steps; min {min(cost['own_us']):.1f}) = "
        f"{100 * cost['share']:.2f}% of this configuration's step ({cost['step_us']:.0f} us, "
        "the median step of 3 real windows)",
        flush=True,
    )
    if args.json:
        benchlib.write_json(
            args.json,
            {
                "command": benchlib.command_line(),
                "date": benchlib.now(),
                "machine": benchlib.machine(),
                **cost,
            },
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60, help="plain loop steps per turn")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--own-cost", action="store_true", help="the window's own cost per step (own_cost)"
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="the plain loop trains gpuopt's model on gpuopt's DataLoader (build_plain)",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [*BASE, *args.overrides]
    print(f"# {benchlib.command_line()}  ({benchlib.now()}, load {benchlib.load()})", flush=True)
    member = build_gpuopt(overrides, Path(tempfile.mkdtemp(prefix="bench_window_")))
    plain = build_plain(overrides, member if args.shared else None)
    if args.own_cost:
        report_own_cost(own_cost(member, args.rounds, args.steps), args)
        return
    values: dict[str, list[float]] = {"gpuopt": [], "plain": []}
    for r in range(args.rounds):
        for name in benchlib.round_order(list(values), r):
            value = gpuopt_window(member) if name == "gpuopt" else plain_window(plain, args.steps)
            values[name].append(value)
        m = member.built.trial.metrics
        print(
            f"  round {r + 1}/{args.rounds}: gpuopt {benchlib.fmt(values['gpuopt'][-1])} "
            f"plain {benchlib.fmt(values['plain'][-1])} samples/s (gpuopt's window: "
            f"{m.timed_steps} steps, {m.stop_reason})",
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
