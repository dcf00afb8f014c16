"""The race's screen: one call of the comparison service (gpuopt.sweeper.comparison).

B ctl B c1 B c2 ... B in one race process: the baseline member's windows are the control, each
arm (the round's control build, policy.CONTROL, then the candidates) is built for its turn,
read in one short window and dropped (`ScreenWindows`, the executor); each arm's ratio is its
window over its two neighbouring baseline windows, then over the control build's
(comparison.calibrated). An arm that costs the process (too slow to build or to step) is read as
"slow" and the next baseline window runs in a new process, the baseline built first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt.core import metrics
from gpuopt.core.result import TrialResult
from gpuopt.core.shared_protocol import Added, Failure, Reading
from gpuopt.sweeper import comparison
from gpuopt.sweeper.comparison import BRACKETED, Budget, Compared, FixedCount, Measurement
from gpuopt.sweeper.race import policy
from gpuopt.sweeper.race.process import RaceProcess

log = logging.getLogger("gpuopt.sweeper")


@dataclass
class Turn:
    """One arm's turn in the screen: its window (or why none), the stored spec its build
    reported, how long the build took."""

    window: Reading | Failure
    config: dict[str, Any] | None = None
    build_s: float | None = None

    def failure(self) -> TrialResult | None:
        """The arm's own failure (an OOM in its build or window) as a trial's result; None for
        a window, or for a turn that cost the process ("slow": no result of the arm's own)."""
        if isinstance(self.window, Failure) and self.window.status != "slow":
            return self.window.result(self.config)
        return None


@dataclass
class ScreenWindows:
    """The screen's executor: the baseline's windows measured in place, each arm built (one
    warm-up step), read in one window and dropped. `configs`: each arm's composed job config;
    `restart()`: a new race process with the baseline built, after one an arm cost."""

    race: RaceProcess
    configs: Mapping[str, Path]
    objective: str
    window_s: float
    floor: float
    restart: Callable[[], RaceProcess]

    @property
    def metric(self) -> str:
        return policy.SCREEN_METRIC[self.objective]

    def __call__(self, label: str, job: int, so_far: Compared) -> Measurement:
        if self.race.error:  # the last arm cost the process
            self.race = self.restart()
        if label == policy.BASELINE:
            window = self.race.measure(policy.BASELINE, self.window_s, policy.SCREEN_MIN_STEPS)
            return self._measurement(window, window)
        turn = self._turn(label, so_far)
        return self._measurement(turn.window, turn)

    def _turn(self, label: str, so_far: Compared) -> Turn:
        """`label` built, read in one window, dropped. A just-built candidate whose drain already
        reads it far below the floor against the baseline's last window is read on its drain
        (policy.give_up_below); the floor is scaled by the control build's ratio, as the race
        reads every candidate over it."""
        built = self.race.add(label, self.configs[label], timeout_s=policy.SCREEN_TIMEOUT_S)
        if isinstance(built, Added):
            give_up = None
            if label != policy.CONTROL:
                scale = control_ratio(so_far, self.metric) or 1.0
                last = so_far.of(policy.BASELINE)[-1].measurement.detail
                give_up = policy.give_up_below(self.objective, self.floor * scale, last.to_json())
            window = self.race.measure(
                label, self.window_s, policy.SCREEN_MIN_STEPS, settle=False, give_up_below=give_up
            )
            self.race.drop(label)
            turn = Turn(window, built.config, built.command_s)
        else:
            turn = Turn(built, None, built.command_s)
        if isinstance(turn.window, Failure) and self.race.error:
            turn.window = Failure(label, "slow", self.race.error)
        return turn

    def _measurement(self, window: Reading | Failure, detail: Any) -> Measurement:
        if isinstance(window, Reading) and window.value(self.metric) is not None:
            return Measurement("ok", window.value(self.metric), detail)
        return Measurement(window.status if isinstance(window, Failure) else "error", None, detail)


def raw_ratios(compared: Compared, metric_name: str) -> dict[str, float | None]:
    """Each arm's window over its neighbouring baseline windows (> 1: faster, whichever way the
    catalogue says the metric is better)."""
    direction = metrics.metric(metric_name).goal or metrics.MAX
    out = {}
    for arm in compared.arms:
        ratio = compared.ratio(arm, direction)
        out[arm] = None if ratio is None else ratio.ratio
    return out


def control_ratio(compared: Compared, metric: str) -> float | None:
    """The control build's ratio over the baseline's windows, once its turn is read."""
    return comparison.calibrated(raw_ratios(compared, metric), policy.CONTROL)[1]


def screen(
    race: RaceProcess,
    configs: Mapping[str, Path],
    objective: str,
    options: Any,
    restart: Callable[[], RaceProcess],
    report: Callable[[str, Turn, float | None], None],
) -> tuple[Compared, ScreenWindows]:
    """The round's screen of `configs` (the control build first, then the candidates), as one
    comparison: the readings, and the executor (its `race`: the process the screen ended in).
    `report(label, turn, ratio)` once an arm's ratio is read (its progress line)."""
    windows = ScreenWindows(race, configs, objective, options.window_s, options.floor, restart)
    metric = windows.metric

    def progress(reading: comparison.Reading, so_far: Compared) -> None:
        before = so_far.readings[-2] if len(so_far.readings) > 1 else None
        if reading.label != policy.BASELINE or before is None or before.label == policy.BASELINE:
            return
        ratios, control = comparison.calibrated(raw_ratios(so_far, metric), policy.CONTROL)
        if before.label == policy.CONTROL and control is not None:
            log.info(
                "race: the baseline's own configuration, built as a candidate, read %.2fx the "
                "baseline's windows: every candidate is read over it (where a build's tensors "
                'land sets its speed: docs/searching.md, "The race")',
                control,
            )
        elif before.label != policy.CONTROL:
            report(before.label, before.measurement.detail, ratios.get(before.label))

    compared = comparison.compare(
        list(configs),
        policy.BASELINE,
        Budget(),
        FixedCount(1),
        windows,
        order=BRACKETED,
        report=progress,
    )
    return compared, windows
