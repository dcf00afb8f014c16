"""`python -m gpuopt.processes.shared_windows SPEC.json`: several configurations of gpuopt's own task built in one
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
  {"epoch_steps": n, "epoch_overhead_s": s, "data_wait": pct}}} - CONFIG.yaml a composed task
  config (as the memory probe reads it); a window lasts window_s and at least min_steps optimizer
  steps; `steady` the sweep's measured epoch boundary per label, to amortize each window as a
  trial does, and its measured data wait (a loader that keeps up needs no drain before a window).
- after building and warming every configuration: {"ready": [LABEL, ...]} (a configuration that
  failed to build answers its windows with its failure).
- each stdin line LABEL: one window of that configuration -> {"label", "status", "throughput",
  "throughput_amortized", "step_time_ms", "steps", "seconds", "drained": the untimed steps
  before it} or {"label", "status", "reason"}.
- stdin closed (or "quit"): everything is released and the process exits 0.
- the race (gpuopt/sweeper/race/) also sends JSON commands, one per line:
  {"op": "add", "label", "config"} builds one more configuration -> {"label", "status", "config":
  its spec as stored, ...}; {"op": "window", "label", "window_s", "min_steps", "deadline_s",
  "settle", "give_up_below"} one window of that length (settle false: no wait for idle workers
  after it, for a configuration dropped next; give_up_below: samples/s under which a drain read
  right after the configuration's own steps ends the window, `"read_on_drain": true`);
  {"op": "drop", "label"} releases it -> {"label", "status": "dropped"}; {"op": "trial", "label",
  "config", "run_dir"} measures CONFIG.yaml as a whole trial of this process (the engine's one
  route, gpuopt.engines.registry.run_trial: its window, extras and profile), result.json and the
  trace in run_dir -> {"label", "result": the TrialResult as a dict}.
- after every window, before the next: this process's children (other configurations' loader
  workers refilling their prefetch queues) are let go idle (gpuopt.core.host.wait_for_idle_children),
  so that one configuration's loading never runs inside another's window.

This module is the process and its protocol; building a configuration and running one window of it
are the native engine's (`gpuopt.engines.native.open_windows`, reached through
`gpuopt.engines.registry.engine_entry`), so the windows train exactly as a trial does.
"""

from __future__ import annotations

import json
import sys
import time
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
    # The last steps this process ran were this member's (its build's warm-up, or its window):
    # its next window needs no re-warming step (WindowedTrial.queued_steps).
    warm: bool = False


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
        member.built.data_wait = steady.get("data_wait")
    except Exception as exc:  # an OOM or a divergence is this configuration's answer
        member.failure = _failure(exc)
        release(member)
    return member


def window(
    member: Member,
    window_s: float,
    min_steps: int,
    deadline_s: float | None = None,
    give_up_below: float | None = None,
) -> dict[str, Any]:
    """One window of the member's configuration (the engine's `WindowedTrial.window`: its
    process-wide settings, the queue drained, then steps until `window_s` and `min_steps`)."""
    from gpuopt.trial.measure import amortized_throughput

    if member.failure is not None:
        return {"label": member.label, **member.failure}
    try:
        steps, seconds, samples = member.built.window(
            window_s, min_steps, deadline_s, warm=member.warm, give_up_below=give_up_below
        )
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
        "drained": member.built.drained,
        "read_on_drain": member.built.read_on_drain,
    }


def release(member: Member) -> None:
    """Stop the member's loader workers and drop what it built."""
    if member.built is not None:
        member.built.close()
    member.built = None


def emit(data: dict[str, Any]) -> None:
    print(json.dumps(data, default=str), flush=True)


def serve(spec: dict[str, Any], commands: Any) -> None:
    """Build every configuration, then answer one command per line (a label: one window)."""
    steady = spec.get("steady") or {}
    members = {
        label: build_member(label, path, steady.get(label) or {})
        for label, path in spec["configs"].items()
    }
    stepped(members, next(reversed(members), None))  # the last one built warmed up last
    emit({"ready": list(members)})
    window_s, min_steps = float(spec.get("window_s", 1.0)), int(spec.get("min_steps", 5))
    for line in commands:
        command = parse_command(line)
        if command.get("op") == "quit":
            break
        started = time.perf_counter()
        out = answer(command, members, window_s, min_steps)
        emit({**out, "command_s": time.perf_counter() - started})
    for member in members.values():
        release(member)


def parse_command(line: str) -> dict[str, Any]:
    """A command line: a JSON object, or a bare label (one window of it) or `quit`."""
    text = line.strip()
    if text.startswith("{"):
        try:
            return dict(json.loads(text))
        except (ValueError, TypeError) as exc:
            return {"op": "invalid", "label": "", "why": str(exc)}
    return {"op": "quit"} if text == "quit" else {"op": "window", "label": text}


def answer(
    command: dict[str, Any], members: dict[str, Member], window_s: float, min_steps: int
) -> dict[str, Any]:
    """One command's answer (see the module's protocol); a window is followed by the settle."""
    from gpuopt.core.host import wait_for_idle_children

    op, label = command.get("op"), str(command.get("label", ""))
    if op == "add":
        if label in members:
            release(members.pop(label))
        members[label] = build_member(label, command["config"], command.get("steady") or {})
        stepped(members, label)
        return added(members[label])
    if op == "trial":
        if label in members:
            release(members.pop(label))
        stepped(members, None)
        return {"label": label, "result": whole_trial(command["config"], command["run_dir"])}
    if op == "drop" and label in members:
        release(members.pop(label))
        return {"label": label, "status": "dropped"}
    if op == "window" and label in members:
        length, steps = float(command.get("window_s", window_s)), command.get("min_steps")
        deadline, give_up = command.get("deadline_s"), command.get("give_up_below")
        out = window(members[label], length, int(steps) if steps else min_steps, deadline, give_up)
        stepped(members, label)
        if command.get("settle", True):
            out["settle_s"] = wait_for_idle_children()
        return out
    why = command.get("why") or f"no configuration {label!r}"
    return {"label": label, "status": "error", "reason": f"{op}: {why}"}


def stepped(members: dict[str, Member], label: str | None) -> None:
    """`label`'s steps ran last in this process (None: another trial's): it alone stays warm."""
    for member in members.values():
        member.warm = member.label == label and member.built is not None


def added(member: Member) -> dict[str, Any]:
    """The answer to `add`: the member's stored spec, or its failure."""
    if member.failure is not None:
        return {"label": member.label, **member.failure}
    from gpuopt.engines.registry import stored_spec

    return {"label": member.label, "status": "ok", "config": stored_spec(member.built.trial.spec)}


def whole_trial(config_path: str, run_dir: str) -> dict[str, Any]:
    """CONFIG.yaml measured as a trial of its own in this process (the engine's one route), its
    result.json (and the profiled window's trace) written into `run_dir`."""
    import os
    from pathlib import Path

    from omegaconf import OmegaConf

    from gpuopt.core.errors import ConfigError
    from gpuopt.core.result import Status, TrialResult
    from gpuopt.engines.registry import load_spec, run_trial
    from gpuopt.trial.profiled_window import RUN_DIR_ENV

    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        spec = load_spec(OmegaConf.load(config_path))
    except ConfigError as exc:
        return TrialResult(status=Status.ERROR, reason=str(exc)).to_dict()
    # The profiled window writes its trace into Hydra's run dir; outside Hydra, into this one.
    previous = os.environ.get(RUN_DIR_ENV)
    os.environ[RUN_DIR_ENV] = str(folder)
    try:
        result = run_trial(spec)
    finally:
        if previous is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = previous
    result.save(folder / "result.json")
    return result.to_dict()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gpuopt.processes.shared_windows SPEC.json", file=sys.stderr)
        return 2
    from gpuopt.core.lifeline import set_parent_death_signal

    set_parent_death_signal()  # the sweep that drives this process gone: so is this process
    with open(args[0]) as handle:
        spec = json.load(handle)
    serve(spec, sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
