"""`python -m gpuopt.processes.shared_windows SPEC.json`: several configurations of gpuopt's own
task built in one process and measured in short alternating windows, one window per command (the
confirmation's in-process mode: gpuopt/sweeper/confirm/in_process.py drives it).

Why: on a shared machine throughput drifts by 10-30% within minutes, and a fresh-process pair of
runs 15-30 s apart sees different drift on each side: paired intervals over such pairs stayed at
+-15-18% (docs/benchmarks.md). Windows a second long, back to back in one process, see the same
machine: the drift cancels within the pair. After every window this process's children (other
configurations' loader workers refilling their queues) are let go idle, so that one
configuration's loading never runs inside another's window. The protocol is
gpuopt.core.shared_protocol's; building and windows are the native engine's (`open_windows`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuopt.core import shared_protocol as protocol
from gpuopt.core.result import TrialResult


@dataclass
class Member:
    """One configuration of the shared process: what the engine built for it, or why it has none."""

    label: str
    built: Any = None  # the engine's windowed trial (gpuopt.engines.native.WindowedTrial)
    steady: protocol.Steady = field(default_factory=protocol.Steady)
    failure: protocol.Failure | None = None  # once it failed
    # This process's last steps were this member's: its next window needs no re-warming step.
    warm: bool = False

    def fail(self, exc: BaseException) -> protocol.Failure:
        """Record the failure (an OOM or a divergence is this configuration's answer), let go."""
        from gpuopt.trial.failures import classify_failure

        status, reason = classify_failure(exc)
        self.failure = protocol.Failure(self.label, status.value, reason)
        release(self)
        return self.failure


def build_member(label: str, config_path: str, steady: protocol.Steady) -> Member:
    """Build the trial and run its warm-up steps (outside any window), as the native engine does."""
    from omegaconf import OmegaConf

    from gpuopt.engines.registry import engine_entry
    from gpuopt.trial.prepare import prepare_trial

    member = Member(label, steady=steady)
    try:
        # One process measures many configurations: it keeps the allocator settings it started with.
        prepared = prepare_trial(OmegaConf.load(config_path), allocator=False)
        member.built = engine_entry("native", "open_windows")(prepared.spec, prepared.device)
        member.built.data_wait = steady.data_wait
    except Exception as exc:
        member.fail(exc)
    return member


def window(
    member: Member,
    window_s: float,
    min_steps: int,
    deadline_s: float | None = None,
    give_up_below: float | None = None,
) -> protocol.Reading | protocol.Failure:
    """One window of the member's configuration (the engine's `WindowedTrial.window`)."""
    from gpuopt.trial.measure import amortized_throughput

    if member.failure is not None:
        return member.failure
    try:
        steps, seconds, samples = member.built.window(
            window_s, min_steps, deadline_s, warm=member.warm, give_up_below=give_up_below
        )
    except Exception as exc:
        return member.fail(exc)
    throughput, step_s = samples / seconds, seconds / steps
    amortized = amortized_throughput(
        throughput, step_s, member.steady.epoch_steps, member.steady.epoch_overhead_s
    )
    return protocol.Reading(
        member.label,
        throughput=throughput,
        throughput_amortized=amortized,
        step_time_ms=1000.0 * step_s,
        steps=steps,
        seconds=seconds,
        drained=member.built.drained,
        read_on_drain=member.built.read_on_drain,
    )


def release(member: Member) -> None:
    """Stop the member's loader workers and drop what it built."""
    if member.built is not None:
        member.built.close()
    member.built = None


def emit(message: protocol.Message) -> None:
    print(json.dumps(message.to_json(), default=str), flush=True)


def serve(spec: protocol.Spec, commands: Any) -> None:
    """Build every configuration, then answer one command per line until stdin closes."""
    members = {
        label: build_member(label, path, spec.steady.get(label) or protocol.Steady())
        for label, path in spec.configs.items()
    }
    stepped(members, next(reversed(members), None))  # the last one built warmed up last
    emit(protocol.Ready(list(members)))
    for line in commands:
        try:
            command = protocol.parse_command(line)
        except ValueError as exc:
            emit(protocol.Failure("", "error", f"invalid command: {exc}"))
            continue
        started = time.perf_counter()
        out = answer(command, members, spec)
        emit(replace(out, command_s=time.perf_counter() - started))
    for member in members.values():
        release(member)


def answer(
    command: protocol.Command, members: dict[str, Member], spec: protocol.Spec
) -> protocol.Answer:
    """One command's answer; a window is followed by the settle (unless it says not to)."""
    from gpuopt.core.host import wait_for_idle_children
    from gpuopt.engines.registry import stored_spec

    label = command.label
    if isinstance(command, (protocol.Add, protocol.Trial)) and label in members:
        release(members.pop(label))
    if isinstance(command, protocol.Add):
        member = members[label] = build_member(label, command.config, command.steady)
        stepped(members, label)
        if member.failure is not None:
            return member.failure
        return protocol.Added(label, stored_spec(member.built.trial.spec))
    if isinstance(command, protocol.Trial):
        stepped(members, None)
        return protocol.TrialDone(label, whole_trial(command.config, command.run_dir))
    if label not in members:
        return protocol.Failure(label, "error", f"{command.op}: no configuration {label!r}")
    if isinstance(command, protocol.Drop):
        release(members.pop(label))
        return protocol.Answer(label, status="dropped")
    length = spec.window_s if command.window_s is None else command.window_s
    steps = command.min_steps or spec.min_steps
    out = window(members[label], length, steps, command.deadline_s, command.give_up_below)
    stepped(members, label)
    if command.settle:
        wait_for_idle_children()
    return out


def stepped(members: dict[str, Member], label: str | None) -> None:
    """`label`'s steps ran last in this process (None: another trial's): it alone stays warm."""
    for member in members.values():
        member.warm = member.label == label and member.built is not None


def whole_trial(config_path: str, run_dir: str) -> TrialResult:
    """CONFIG.yaml measured as a whole trial in this process, its result.json (and the profiled
    window's trace) written into `run_dir`."""
    from omegaconf import OmegaConf

    from gpuopt.core.errors import ConfigError
    from gpuopt.core.result import Status
    from gpuopt.engines.registry import run_trial
    from gpuopt.trial.prepare import prepare_trial
    from gpuopt.trial.profiled_window import RUN_DIR_ENV

    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        prepared = prepare_trial(OmegaConf.load(config_path), allocator=False)
    except ConfigError as exc:
        return TrialResult(status=Status.ERROR, reason=str(exc))
    # The profiled window writes its trace into Hydra's run dir; outside Hydra, into this one (set
    # for each whole trial: nothing else in this process reads it).
    os.environ[RUN_DIR_ENV] = str(folder)
    result = run_trial(prepared.spec, device=prepared.device)
    result.save(folder / "result.json")
    return result


def main() -> int:
    args = sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m gpuopt.processes.shared_windows SPEC.json", file=sys.stderr)
        return 2
    import faulthandler

    from gpuopt.core.lifeline import set_parent_death_signal

    faulthandler.enable()  # torch aborting in native code: its Python frames in the log (the reason)
    set_parent_death_signal()  # the sweep that drives this process gone: so is this process
    serve(protocol.Spec.read(Path(args[0])), sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
