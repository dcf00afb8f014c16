"""`python -m gpuopt.trial.interleave SPEC.json`: several configurations of gpuopt's own task built in one
process and measured in short alternating windows, one window per command (the confirmation's
in-process mode: gpuopt/sweeper/confirm/in_process.py drives it, gpuopt/sweeper/confirm/rounds.py decides when).

Why: on a shared machine throughput drifts by 10-30% within minutes (CPU steal, other work), and
a fresh-process pair of runs 15-30 s apart sees different drift on each side: paired intervals
over such pairs stayed at +-15-18% (docs/benchmarks.md). Windows a second long, back to back in
one process, see the same machine: the drift cancels within the pair. Only configurations that can
share a process are measured so (`gpuopt.sweeper.confirm.in_process.shareable`): DataLoader settings,
batch and accumulation, threads, precision; not allocator settings or torch.compile modes, which
are process-wide or change what later code runs.

Protocol (one JSON object per line on stdout):
- SPEC.json: {"configs": {LABEL: CONFIG.yaml}, "window_s": s, "min_steps": n, "steady": {LABEL:
  {"epoch_steps": n, "epoch_overhead_s": s}}} - CONFIG.yaml a composed task config (as the memory
  probe reads it); a window lasts window_s and at least min_steps optimizer steps; `steady` the
  sweep's measured epoch boundary per label, to amortize each window as a trial does.
- after building and warming every configuration: {"ready": [LABEL, ...]} (a configuration that
  failed to build answers its windows with its failure).
- each stdin line LABEL: one window of that configuration -> {"label", "status", "throughput",
  "throughput_amortized", "step_time_ms", "steps", "seconds"} or {"label", "status", "reason"}.
- stdin closed (or "quit"): everything is released and the process exits 0.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Member:
    """One configuration of the shared process: its built trial, or why it has none."""

    label: str
    trial: Any = None  # gpuopt.engines._common.Trial
    workload: Any = None  # gpuopt.engines.native.Workload
    feed: Any = None  # gpuopt.engines._common.BatchFeed
    cache: Any = None  # gpuopt.trial.knobs.CachePolicy (its after_step hook)
    epoch_steps: int | None = None
    epoch_overhead_s: float | None = None
    failure: dict[str, Any] | None = None  # {"status", "reason"} once it failed


def _failure(exc: BaseException) -> dict[str, Any]:
    from gpuopt.engines._common import classify_failure

    status, reason = classify_failure(exc)
    return {"status": status.value, "reason": reason}


def build_member(label: str, config_path: str, steady: dict[str, Any]) -> Member:
    """Build the trial as the native engine does, then its warm-up steps (outside any window)."""
    from omegaconf import OmegaConf

    from gpuopt.engines import native
    from gpuopt.engines._common import Trial, apply_policies
    from gpuopt.engines.registry import load_spec
    from gpuopt.env import check_device_support

    member = Member(label, epoch_steps=steady.get("epoch_steps"))
    member.epoch_overhead_s = steady.get("epoch_overhead_s")
    try:
        spec = load_spec(OmegaConf.load(config_path))
        device, _ = check_device_support(spec)
        member.trial = Trial(spec, device)
        policies = apply_policies(spec, device)
        member.cache = policies.cache
        member.workload, member.feed = native.build(member.trial, policies)
        for _ in range(spec.measure.warmup_steps):
            member.workload.train_step(member.feed.next_step())
        member.workload.check_finite("warm-up")
    except Exception as exc:  # an OOM or a divergence is this configuration's answer
        member.failure = _failure(exc)
        release(member)
    return member


def queued_batches(member: Member) -> int:
    """Optimizer steps whose batches the idle loader's workers prefetched while another
    configuration was measured: run untimed, so a window starts at the steady rate."""
    loader = member.trial.spec.loader
    prefetched = loader.num_workers * (loader.prefetch_factor or 2) if loader.num_workers else 0
    return -(-prefetched // member.workload.accumulation_steps) + 1


def window(member: Member, window_s: float, min_steps: int) -> dict[str, Any]:
    """One window: the process-wide settings of this configuration (threads, matmul precision),
    the queue drained, then optimizer steps until `window_s` and `min_steps` are both reached."""
    from gpuopt.engines._common import apply_policies
    from gpuopt.trial.measure import amortized_throughput, synchronize

    if member.failure is not None:
        return {"label": member.label, **member.failure}
    trial, workload, feed = member.trial, member.workload, member.feed
    try:
        apply_policies(trial.spec, trial.device)
        for _ in range(queued_batches(member)):
            workload.train_step(feed.next_step())
        synchronize(trial.device)
        feed.reset_counters()
        steps, started = 0, time.perf_counter()
        while steps < min_steps or time.perf_counter() - started < window_s:
            workload.train_step(feed.next_step())
            member.cache.after_step(steps)
            steps += 1
        synchronize(trial.device)
        seconds = time.perf_counter() - started
        workload.check_finite("an interleaved window")
    except Exception as exc:
        member.failure = _failure(exc)
        release(member)
        return {"label": member.label, **member.failure}
    throughput = feed.samples / seconds
    step_s = seconds / steps
    return {
        "label": member.label,
        "status": "ok",
        "throughput": throughput,
        "throughput_amortized": amortized_throughput(
            throughput, step_s, member.epoch_steps, member.epoch_overhead_s
        ),
        "step_time_ms": 1000.0 * step_s,
        "steps": steps,
        "seconds": seconds,
    }


def release(member: Member) -> None:
    """Stop the member's loader workers and drop what it built."""
    if member.feed is not None:
        member.feed.close()
    member.trial = member.workload = member.feed = None


def emit(data: dict[str, Any]) -> None:
    print(json.dumps(data, default=str), flush=True)


def serve(spec: dict[str, Any], commands: Any) -> None:
    """Build every configuration, then answer one window per command line."""
    steady = spec.get("steady") or {}
    members = {
        label: build_member(label, path, steady.get(label) or {})
        for label, path in spec["configs"].items()
    }
    emit({"ready": list(members)})
    window_s, min_steps = float(spec.get("window_s", 1.0)), int(spec.get("min_steps", 5))
    for line in commands:
        label = line.strip()
        if label == "quit":
            break
        if label not in members:
            emit({"label": label, "status": "error", "reason": f"no configuration {label!r}"})
            continue
        emit(window(members[label], window_s, min_steps))
    for member in members.values():
        release(member)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gpuopt.trial.interleave SPEC.json", file=sys.stderr)
        return 2
    from gpuopt.core.lifeline import set_parent_death_signal

    set_parent_death_signal()  # the sweep that drives this process gone: so is this process
    with open(args[0]) as handle:
        spec = json.load(handle)
    serve(spec, sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
