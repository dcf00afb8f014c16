"""The race's one process, sweeper side: `python -m gpuopt.processes.shared_windows` (the confirmation's
shared process) started with no configuration, then told to build configurations one at a time
(`add`), to measure windows of a given length, to release a configuration (`drop`), and to measure
one as a whole trial of that process (`trial`: the engine's one route, extras and profile
included). Every answer is one JSON line; the process dies with the sweep (parent-death signal)
and is killed with its loader workers on close (SharedProcess)."""

from __future__ import annotations

from pathlib import Path

from gpuopt.core.result import TrialResult
from gpuopt.core.shared_protocol import Drop, Failure, Reading, Trial, TrialDone, Window
from gpuopt.sweeper.confirm.in_process import SharedProcess
from gpuopt.sweeper.race import policy

TRIAL_TIMEOUT_S = 1200.0  # one whole trial (the fresh-process launcher's default timeout_s)


class RaceProcess(SharedProcess):
    """The shared process, driven by the race's commands (gpuopt.core.shared_protocol)."""

    @classmethod
    def open(cls, directory: Path, objective: str, window_s: float) -> RaceProcess:
        directory.mkdir(parents=True, exist_ok=True)
        process = cls.start({}, {}, objective, window_s, directory)
        assert isinstance(process, RaceProcess)
        return process

    def measure(
        self,
        label: str,
        window_s: float,
        min_steps: int,
        settle: bool = True,
        give_up_below: float | None = None,
    ) -> Reading | Failure:
        """One window of `label` (`window_s` and at least `min_steps` optimizer steps), cut short
        after SCREEN_DEADLINE x `window_s`; `settle` false for a configuration dropped right after
        (its workers need not go idle); `give_up_below` (samples/s): a just-built configuration
        whose drain reads slower is read on its drain (`read_on_drain`)."""
        deadline_s = policy.SCREEN_DEADLINE * window_s
        command = Window(label, window_s, min_steps, deadline_s, settle, give_up_below)
        answer = self.command(command, policy.SCREEN_TIMEOUT_S)
        assert isinstance(answer, (Reading, Failure))
        return answer

    def drop(self, label: str) -> None:
        self.command(Drop(label), policy.SCREEN_TIMEOUT_S)

    def whole_trial(self, label: str, config: Path, run_dir: Path) -> TrialResult | None:
        """`config` measured as a whole trial of this process; its TrialResult, or None when the
        process failed (`error` says why)."""
        answer = self.command(Trial(label, str(config), str(run_dir)), TRIAL_TIMEOUT_S)
        return answer.result if isinstance(answer, TrialDone) else None
