"""The shared measuring process, sweeper side (torch-free): `python -m gpuopt.processes.shared_windows`
driven one command at a time (gpuopt.core.shared_protocol) for the race and the in-process
confirmation (which configurations may share it: race/policy.shareable).
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
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from gpuopt.core import shared_protocol as protocol
from gpuopt.core.result import TrialResult
from gpuopt.sweeper.launchers.results import describe_exit, fatal_error
from gpuopt.sweeper.objectives import TrialOutcome, error_outcome

log = logging.getLogger("gpuopt.sweeper")

MIN_STEPS = 3  # a window is at least this many optimizer steps, however long they take
READY_TIMEOUT_S = 600.0  # building and warming every member (a GPT-2 124M on CPU: ~2 min)
WINDOW_TIMEOUT_S = 120.0  # one window beyond its length (MIN_STEPS slow steps)
TRIAL_TIMEOUT_S = 1200.0  # one whole trial (the fresh-process launcher's default timeout_s)
PROGRESS_S = 10.0  # a line this often while an answer takes long: a sweep never looks hung
# A screening window's drain and its steps each end after one step once they took this many
# window lengths: a candidate of long steps (a cnn's batch 256-512: 1-2 s a step on a 2-core CPU)
# is read on one step a window; its loader keeps up with such steps, so no prefetched batch
# flatters it, and one long step varies by a few percent: enough to rank it.
SCREEN_DEADLINE = 3.0
# A candidate whose build or window takes longer than this is pruned: its steps are that slow
# (fp16 convolutions on some CPUs: minutes a step). The process is restarted without it.
SCREEN_TIMEOUT_S = 60.0


def write_config(config: Any, directory: Path, name: str) -> Path:
    """The composed task config (no hydra node, resolved) as `directory/name`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    path.write_text(OmegaConf.to_yaml(task, resolve=True))
    return path


class SharedProcess:
    """The process, asked one command at a time; it dies with the sweep (parent-death signal) and
    is killed with its DataLoader workers (its own process group) on close or a timeout."""

    def __init__(self, process: subprocess.Popen, objective: str, log_path: Path) -> None:
        self.process, self.objective, self.log_path = process, objective, log_path
        self._selector = selectors.DefaultSelector()
        self._selector.register(process.stdout, selectors.EVENT_READ)
        self.error: str | None = None
        self.what = "gpuopt.processes.shared_windows"  # the progress lines' name for it
        # What each member was built from at start (its config file and steady facts).
        self.members: dict[str, tuple[Path, protocol.Steady]] = {}

    @classmethod
    def start(
        cls,
        configs: Mapping[str, Path],
        steady: Mapping[str, Mapping[str, Any]],
        objective: str,
        window_s: float,
        directory: Path,
    ) -> SharedProcess:
        files = {k: str(v) for k, v in configs.items()}
        facts = {k: protocol.Steady.from_json(dict(v)) for k, v in steady.items()}
        path = directory / "interleave.json"
        protocol.Spec(files, window_s, MIN_STEPS, facts).write(path)
        log_path = directory / "interleave.log"
        stderr = open(log_path, "w")  # noqa: SIM115 - the child writes to it
        process = subprocess.Popen(
            [sys.executable, "-m", "gpuopt.processes.shared_windows", str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        stderr.close()
        shared = cls(process, objective, log_path)
        shared.members = {k: (Path(v), facts.get(k, protocol.Steady())) for k, v in configs.items()}
        ready = shared._read(READY_TIMEOUT_S)
        if ready is not None and "ready" not in ready:
            shared._fail(f"unexpected first line {ready}")
        return shared

    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        """The child's next JSON line, or None (and `error` set) when it ended or timed out."""
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
        """How the process ended, with the native crash its log names, if any."""
        why = f"gpuopt.processes.shared_windows {describe_exit(self.process.wait())}"
        crash = fatal_error(self.log_path)
        return f"{why}: {crash}" if crash else why

    def _fail(self, why: str) -> None:
        self.error = why
        self.close()

    def command(self, command: protocol.Command, timeout_s: float) -> protocol.Answer:
        """One command's answer, or a Failure ("error") once the process failed."""
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
        timeout_s: float = READY_TIMEOUT_S,
        steady: protocol.Steady | None = None,
    ) -> protocol.Added | protocol.Failure:
        """Build `config` as `label`, warmed up (one it had is released first)."""
        command = protocol.Add(label, str(config), steady or protocol.Steady())
        return self.command(command, timeout_s)  # type: ignore[return-value]

    def window(self, label: str) -> TrialOutcome:
        """One window of `label` (the spec's length) as a TrialOutcome."""
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

    @classmethod
    def open(cls, directory: Path, objective: str, window_s: float) -> SharedProcess:
        """The race's process: started with no configuration, each built on command (`add`)."""
        directory.mkdir(parents=True, exist_ok=True)
        return cls.start({}, {}, objective, window_s, directory)

    def measure(
        self,
        label: str,
        window_s: float,
        min_steps: int,
        settle: bool = True,
        give_up_below: float | None = None,
    ) -> protocol.Reading | protocol.Failure:
        """One window of `label`, cut short after SCREEN_DEADLINE x `window_s`; `settle` false for a
        configuration dropped right after; `give_up_below` (samples/s): a just-built configuration
        whose drain reads slower is read on its drain (`read_on_drain`)."""
        deadline_s = SCREEN_DEADLINE * window_s
        command = protocol.Window(label, window_s, min_steps, deadline_s, settle, give_up_below)
        return self.command(command, SCREEN_TIMEOUT_S)  # type: ignore[return-value]

    def drop(self, label: str) -> None:
        self.command(protocol.Drop(label), SCREEN_TIMEOUT_S)

    def whole_trial(self, label: str, config: Path, run_dir: Path) -> TrialResult | None:
        """`config` measured as a whole trial of this process; None when the process failed."""
        answer = self.command(protocol.Trial(label, str(config), str(run_dir)), TRIAL_TIMEOUT_S)
        return answer.result if isinstance(answer, protocol.TrialDone) else None
