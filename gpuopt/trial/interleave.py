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

This module is the process and its protocol; building a configuration and running one window of it
are the native engine's (`gpuopt.engines.native.open_windows`, reached through
`gpuopt.engines.registry.engine_entry`), so the windows train exactly as a trial does.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class Member:
    """One configuration of the shared process: what the engine built for it, or why it has none."""

    label: str
    built: Any = None  # the engine's windowed trial (gpuopt.engines.native.WindowedTrial)
    epoch_steps: int | None = None
    epoch_overhead_s: float | None = None
    failure: dict[str, Any] | None = None  # {"status", "reason"} once it failed


def _failure(exc: BaseException) -> dict[str, Any]:
    from gpuopt.trial.failures import classify_failure

    status, reason = classify_failure(exc)
    return {"status": status.value, "reason": reason}


def build_member(label: str, config_path: str, steady: dict[str, Any]) -> Member:
    """Build the trial as the native engine does, then its warm-up steps (outside any window):
    gpuopt's own loop, reached through the registry (`open_windows`)."""
    from omegaconf import OmegaConf

    from gpuopt.engines.registry import engine_entry, load_spec
    from gpuopt.trial.devices import trial_device

    member = Member(label, epoch_steps=steady.get("epoch_steps"))
    member.epoch_overhead_s = steady.get("epoch_overhead_s")
    try:
        spec = load_spec(OmegaConf.load(config_path))
        device, _ = trial_device(spec)
        member.built = engine_entry("native", "open_windows")(spec, device)
    except Exception as exc:  # an OOM or a divergence is this configuration's answer
        member.failure = _failure(exc)
        release(member)
    return member


def window(member: Member, window_s: float, min_steps: int) -> dict[str, Any]:
    """One window of the member's configuration (the engine's `WindowedTrial.window`: its
    process-wide settings, the queue drained, then steps until `window_s` and `min_steps`)."""
    from gpuopt.trial.measure import amortized_throughput

    if member.failure is not None:
        return {"label": member.label, **member.failure}
    try:
        steps, seconds, samples = member.built.window(window_s, min_steps)
    except Exception as exc:
        member.failure = _failure(exc)
        release(member)
        return {"label": member.label, **member.failure}
    throughput = samples / seconds
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
    if member.built is not None:
        member.built.close()
    member.built = None


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
