"""The confirmation's in-process mode, sweeper side (torch-free): which candidates may share one
process with the baseline (`shareable`), how many windows the budget buys (`window_plan`), and the
process of `python -m gpuopt.processes.shared_windows` driven one window at a time (`SharedProcess`), each
window's answer a TrialOutcome like a fresh-process run's.

Fresh-process pairs stay the mode for everything else: a task of its own (gpuopt cannot build it),
the Lightning engine, torch.compile, allocator and cache settings, another model or dataset.
In-process windows read a long-lived process, faster than a fresh one; both sides of every pair are
in that process, so the ratio is fair, and the mode is recorded with the confirmation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from gpuopt.core import knobs
from gpuopt.core import shared_protocol as protocol
from gpuopt.core.metrics import names
from gpuopt.study.configs import config_of, flatten
from gpuopt.study.keys import ATTR_OVERRIDES
from gpuopt.sweeper.objectives import TrialOutcome, error_outcome

log = logging.getLogger("gpuopt.sweeper")

FIRST_STAGE_ROUNDS = 8  # windows are cheap: a first stage with more df narrows Stein's interval
# ...as many of those rounds as fit in this many seconds (at least confirm.rounds): 8 rounds of
# 0.5 s windows take ~12 s, of a cnn's 3-step windows of 0.3 s steps ~30 s, and the spread of
# such slow windows is small (a +-1.3% interval after 8 rounds: docs/benchmarks.md); Stein's
# second stage adds rounds where the first ones say the interval needs them.
FIRST_STAGE_S = 16.0
MIN_STEPS = 3  # a window is at least this many optimizer steps, however long they take
MAX_WINDOWS = 400
READY_TIMEOUT_S = 600.0  # building and warming every member (a GPT-2 124M on CPU: ~2 min)
WINDOW_TIMEOUT_S = 120.0  # one window beyond its length (MIN_STEPS slow steps)
PROGRESS_S = 10.0  # a line this often while an answer takes long: a sweep never looks hung
# What each arm's trial measured that its windows use: the epoch boundary (amortized as the trial
# did) and the data wait (a loader that keeps up is not drained before a window).
STEADY_FACTS = names(window="uses")


def shareable(baseline: Mapping[str, Any], candidate: Mapping[str, Any]) -> str | None:
    """Why `candidate` cannot share a process with `baseline` (their stored spec dicts), or None."""
    if not baseline or not candidate:
        return "no resolved gpuopt trial config (a task of its own)"
    for config in (baseline, candidate):
        if (config.get("engine") or {}).get("name", "native") != "native":
            return "the Lightning engine builds its own loop"
        if (config.get("compile") or {}).get("mode", "off") != "off":
            return "torch.compile"
        if (config.get("distributed") or {}).get("kind", "none") != "none":
            return "a distributed trial starts its own ranks"
    a, b = flatten(dict(baseline)), flatten(dict(candidate))
    differing = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    # Shareable knobs: each member builds its own loader, model and optimizer, and the process-wide
    # settings (threads, matmul precision) are re-applied before each window (gpuopt.core.knobs).
    apart = [k for k in differing if not knobs.shareable(k)]
    return f"{apart[0]} differs" if apart else None


def window_seconds(trial: Any, window_s: float) -> float:
    """What one window of `trial`'s configuration takes: `window_s`, or MIN_STEPS of its measured
    steps when those are longer, plus the drained step."""
    step_ms = trial.user_attrs.get("step_time_ms")
    step_s = step_ms / 1000.0 if isinstance(step_ms, (int, float)) and step_ms > 0 else 0.0
    return max(window_s, MIN_STEPS * step_s) + step_s


def window_plan(
    rounds: int, max_runs: int, trial_seconds: Sequence[float], windows_s: Sequence[float]
) -> tuple[int, int]:
    """(first-stage rounds, cap on windows) for arms whose windows take `windows_s`: the
    fresh-process cap's time (max_runs runs of the sweep's median trial) spent on windows; the
    first stage as many rounds (up to FIRST_STAGE_ROUNDS, at least `rounds`) as FIRST_STAGE_S
    holds."""
    median = sorted(trial_seconds)[len(trial_seconds) // 2] if trial_seconds else 10.0
    arms, round_s = len(windows_s), sum(windows_s)
    windows = int(max_runs * median / (round_s / arms))
    cap = max(2 * arms, min(MAX_WINDOWS, windows))
    fitting = int(FIRST_STAGE_S // round_s) if round_s > 0 else FIRST_STAGE_ROUNDS
    first = max(2, min(max(rounds, min(FIRST_STAGE_ROUNDS, fitting)), cap // arms))
    return first, cap


class SharedProcess:
    """`python -m gpuopt.processes.shared_windows` with every configuration built once, asked for one window
    at a time; it dies with the sweep (parent-death signal) and is killed, with its DataLoader
    workers (its own process group), on close or a timeout."""

    def __init__(
        self, process: subprocess.Popen, objective: str, log_path: Path | None = None
    ) -> None:
        self.process, self.objective, self.log_path = process, objective, log_path
        self._selector = selectors.DefaultSelector()
        self._selector.register(process.stdout, selectors.EVENT_READ)
        self.error: str | None = None
        self.what = (
            "gpuopt.processes.shared_windows"  # what the progress lines name (the last command)
        )

    @classmethod
    def start(
        cls,
        configs: Mapping[str, Path],
        steady: Mapping[str, Mapping[str, Any]],
        objective: str,
        window_s: float,
        directory: Path,
        python: str | None = None,
    ) -> SharedProcess:
        files = {k: str(v) for k, v in configs.items()}
        facts = {k: protocol.Steady.from_json(dict(v)) for k, v in steady.items()}
        path = directory / "interleave.json"
        protocol.Spec(files, window_s, MIN_STEPS, facts).write(path)
        stderr = open(directory / "interleave.log", "w")  # noqa: SIM115 - the child writes to it
        process = subprocess.Popen(
            [python or sys.executable, "-m", "gpuopt.processes.shared_windows", str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        stderr.close()
        shared = cls(process, objective, directory / "interleave.log")
        ready = shared._read(READY_TIMEOUT_S)
        if ready is not None and "ready" not in ready:
            shared._fail(f"unexpected first line {ready}")
        return shared

    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        """The child's next JSON line, or None (and `error` set) when it ended or timed out;
        while it takes long (a whole trial of a slow model), a line every PROGRESS_S seconds."""
        if self.error:
            return None
        started = time.monotonic()
        deadline, next_line = started + timeout_s, started + PROGRESS_S
        while (left := deadline - time.monotonic()) > 0:
            if not self._selector.select(timeout=min(left, max(0.0, next_line - time.monotonic()))):
                if time.monotonic() >= next_line:
                    waited = time.monotonic() - started
                    log.info("%s: still measuring (%.0f s so far)", self.what, waited)
                    next_line += PROGRESS_S
                continue
            line = self.process.stdout.readline()
            if not line:
                self._fail(self._death())
                return None
            with suppress(json.JSONDecodeError):
                return json.loads(line)
        self._fail(f"gpuopt.processes.shared_windows gave no answer within {timeout_s:g} s")
        return None

    def _death(self) -> str:
        """How the process ended, in words, with the native crash its log names (faulthandler's
        "Fatal Python error" line and the frame that was running), if any."""
        from gpuopt.sweeper.launchers.results import describe_exit, fatal_error

        why = f"gpuopt.processes.shared_windows {describe_exit(self.process.wait())}"
        crash = fatal_error(self.log_path) if self.log_path is not None else None
        return f"{why}: {crash}" if crash else why

    def _fail(self, why: str) -> None:
        self.error = why
        self.close()

    def command(self, command: protocol.Command, timeout_s: float) -> protocol.Answer:
        """Send one command (gpuopt.core.shared_protocol); its answer, or a Failure ("error")
        once the process failed."""
        self.what = f"{command.label} ({command.op})"
        if not self.error:
            try:
                self.process.stdin.write(json.dumps(command.to_json()) + "\n")
                self.process.stdin.flush()
            except OSError as exc:
                self._fail(f"gpuopt.processes.shared_windows: {exc}")
        answer = self._read(timeout_s)
        if answer is None:
            return protocol.Failure(command.label, "error", self.error or "no answer")
        return protocol.answer_from_json(answer, command.answer)

    def add(
        self,
        label: str,
        config: Path,
        steady: protocol.Steady | None = None,
        timeout_s: float = READY_TIMEOUT_S,
    ) -> protocol.Added | protocol.Failure:
        """Build `config` (a composed job config) as `label`, warmed up (one it had is released
        first)."""
        answer = self.command(
            protocol.Add(label, str(config), steady or protocol.Steady()), timeout_s
        )
        assert isinstance(answer, (protocol.Added, protocol.Failure))
        return answer

    def window(self, label: str) -> TrialOutcome:
        """One window of `label` (the spec's length), as the TrialOutcome of its objective."""
        answer = self.command(protocol.Window(label), WINDOW_TIMEOUT_S)
        if isinstance(answer, protocol.Failure):
            if self.error:
                return error_outcome(answer.reason)
            return TrialOutcome(answer.status, None, user_attrs={"reason": answer.reason})
        value = answer.value(self.objective) if isinstance(answer, protocol.Reading) else None
        if value is None or not math.isfinite(value):
            return error_outcome(f"no {self.objective} in {answer}")
        return TrialOutcome("ok", [float(value)], user_attrs=answer.to_json())

    def close(self) -> None:
        if self.process.poll() is None:
            with suppress(OSError):
                self.process.stdin.close()
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        if self.process.poll() is None:
            with suppress(OSError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        with suppress(OSError, ValueError):
            self._selector.close()


def open_shared(
    trials: Sequence[Any],
    labels: Sequence[str],
    compose: Callable[[list[str]], Any],
    objective: str,
    window_s: float,
    directory: Path,
) -> SharedProcess | None:
    """The shared process for these trials (baseline first), or None with the reason logged:
    a member that cannot share, or the process failed to build them."""
    from gpuopt.sweeper.memory_axis import write_probe_config

    configs = [config_of(t.user_attrs) for t in trials]
    for label, config in zip(labels[1:], configs[1:], strict=True):
        why = shareable(configs[0], config)
        if why:
            log.info("confirmation in fresh processes: %s cannot share a process (%s)", label, why)
            return None
    directory.mkdir(parents=True, exist_ok=True)
    paths, steady = {}, {}
    for label, trial in zip(labels, trials, strict=True):
        overrides = list(trial.user_attrs.get(ATTR_OVERRIDES) or [])
        paths[label] = write_probe_config(compose(overrides), directory, f"{label}.yaml")
        steady[label] = {k: trial.user_attrs.get(k) for k in STEADY_FACTS}
    shared = SharedProcess.start(paths, steady, objective, window_s, directory)
    if shared.error:
        log.warning("confirmation in fresh processes: %s", shared.error)
        return None
    return shared
