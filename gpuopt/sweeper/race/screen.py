"""The race's two calls of the comparison service (gpuopt.sweeper.comparison): the screen, and a
finalist's read over the baseline.

B ctl B ctl ... B c1 B c1 ... B in one race process: the baseline member's windows are the
control; each arm (the round's control build, policy.CONTROL, then the candidates) is built for its
turn, read in `race.slices` short windows, each between two of the baseline's, and dropped
(`ScreenWindows`); its ratio is read over the control build's (comparison.calibrated). An arm that
costs the process (too slow to build or to step) is read as "slow" and the process restarted.

A finalist is read over the baseline again, in 4x the screen's windows, before its whole trial
(`read_over_baseline`), and its whole trial told in the baseline's frame (`over_baseline`). Why: a
whole trial is one long window at a time of its own: the baseline's configuration measured again
as a whole trial in the race process read 0.76-1.20x its first (A/A, docs/benchmarks.md), so a
real 1.3x finalist could read 0.87x and be taken for no answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuopt.core import metrics
from gpuopt.core.result import TrialResult
from gpuopt.core.shared_protocol import Added, Failure, Reading
from gpuopt.core.stats import Speedup
from gpuopt.sweeper import comparison
from gpuopt.sweeper.comparison import BRACKETED, Budget, Compared, FixedCount, Measurement
from gpuopt.sweeper.race import policy
from gpuopt.sweeper.shared_process import SCREEN_TIMEOUT_S, SharedProcess

log = logging.getLogger("gpuopt.sweeper")


@dataclass
class Turn:
    """One arm's turn in the screen: its windows as one (`window`: the first failure, else them
    joined), the stored spec its build reported, how long the build took."""

    window: Reading | Failure | None  # None: built, no window read yet
    config: dict[str, Any] | None = None
    build_s: float | None = None
    slices: list[Reading | Failure] = field(default_factory=list)

    def add(self, window: Reading | Failure) -> None:
        self.slices.append(window)
        failed = [w for w in self.slices if isinstance(w, Failure)]
        self.window = failed[0] if failed else joined(self.slices)  # type: ignore[arg-type]

    @property
    def seconds(self) -> float:
        return sum(w.seconds for w in self.slices if isinstance(w, Reading))

    def failure(self) -> TrialResult | None:
        """The arm's own failure (an OOM in its build or window) as a trial's result; None for a
        window or a turn that cost the process ("slow")."""
        if isinstance(self.window, Failure) and self.window.status != "slow":
            return self.window.result(self.config)
        return None


def joined(windows: Sequence[Reading]) -> Reading:
    """Windows of one configuration as one reading: each rate weighted by its window's seconds,
    the drain of the first (a just-built arm's)."""
    seconds = sum(w.seconds for w in windows)
    steps = sum(w.steps for w in windows)

    def weighted(rates: list[float | None]) -> float | None:
        if any(r is None for r in rates):
            return None
        return sum(r * w.seconds for r, w in zip(rates, windows, strict=True)) / seconds  # type: ignore[operator]

    return Reading(
        windows[0].label,
        throughput=weighted([w.throughput for w in windows]) or 0.0,
        throughput_amortized=weighted([w.throughput_amortized for w in windows]),
        step_time_ms=1000.0 * seconds / steps,
        steps=steps,
        seconds=seconds,
        drained=windows[0].drained,
        read_on_drain=windows[0].read_on_drain,
    )


@dataclass
class ScreenWindows:
    """The screen's executor: each arm built for its turn, read in `slices` windows (or as many
    windows' seconds: long steps), then dropped; `restart()`: a new race process with the
    baseline built, after one an arm cost."""

    race: SharedProcess
    configs: Mapping[str, Path]
    objective: str
    window_s: float
    floor: float
    restart: Callable[[], SharedProcess]
    slices: int = 1
    give_up: bool = True  # a just-built arm far below the floor is read on its drain (the screen)
    turns: dict[str, Turn] = field(default_factory=dict)

    @property
    def metric(self) -> str:
        return policy.SCREEN_METRIC[self.objective]

    def __call__(self, label: str, job: int, so_far: Compared) -> Measurement:
        if self.race.error:  # the last arm cost the process
            self.race = self.restart()
        if label == policy.BASELINE:
            return self._measurement(self.race.measure(policy.BASELINE, self.window_s, 1))
        turn = self.turns.get(label)
        if turn is None:
            turn = self.turns[label] = self._built(label)
            if isinstance(turn.window, Failure):
                return self._measurement(turn.window, last=True)
        window = self._window(label, not turn.slices, so_far)
        turn.add(window)
        last = (
            len(turn.slices) >= self.slices
            or turn.seconds >= self.slices * self.window_s
            or (isinstance(window, Reading) and window.read_on_drain)
        )
        if last and not self.race.error:
            self.race.drop(label)
        return self._measurement(window, last)

    def _built(self, label: str) -> Turn:
        """`label` built for its turn (its failure the turn's window where it did not build)."""
        built = self.race.add(label, self.configs[label], timeout_s=SCREEN_TIMEOUT_S)
        if isinstance(built, Added):
            return Turn(None, built.config, built.command_s)
        return Turn(self._slow(built), None, built.command_s)

    def _window(self, label: str, first: bool, so_far: Compared) -> Reading | Failure:
        """One window of `label`; a just-built candidate whose drain reads it far below the floor
        (policy.give_up_below, scaled by the control build's ratio) is read on its drain."""
        give_up = None
        if first and self.give_up and label != policy.CONTROL:
            raw = raw_ratios(so_far, self.metric)
            scale = comparison.calibrated(raw, policy.CONTROL)[1] or 1.0
            last = so_far.of(policy.BASELINE)[-1].measurement.detail
            if isinstance(last, Reading):
                give_up = policy.give_up_below(self.objective, self.floor * scale, last.to_json())
        window = self.race.measure(label, self.window_s, 1, give_up_below=give_up)
        return self._slow(window)

    def _slow(self, answer: Any) -> Any:
        """A failure that cost the process is the arm's "slow" (the process is restarted)."""
        if isinstance(answer, Failure) and self.race.error:
            return Failure(answer.label, "slow", self.race.error)
        return answer

    def _measurement(self, window: Reading | Failure, last: bool = False) -> Measurement:
        """The window as the service's measurement (its detail: the window)."""
        if isinstance(window, Reading) and window.value(self.metric) is not None:
            return Measurement("ok", window.value(self.metric), window, last)
        status = window.status if isinstance(window, Failure) else "error"
        return Measurement(status, None, window, last)


def raw_ratios(compared: Compared, metric_name: str) -> dict[str, float | None]:
    """Each arm's window over its neighbouring baseline windows (> 1: faster)."""
    ratios = {arm: window_ratio(compared, arm, metric_name) for arm in compared.arms}
    return {arm: None if r is None else r.ratio for arm, r in ratios.items()}


def window_ratio(compared: Compared, label: str, metric_name: str) -> Speedup | None:
    """The arm's paired speedup over the baseline on one window metric; None without a pair."""

    def value(reading: comparison.Reading) -> float | None:
        window = reading.measurement.detail
        return window.value(metric_name) if isinstance(window, Reading) else None

    direction = metrics.metric(metric_name).goal or metrics.MAX
    return compared.ratio(label, direction, value=value)


def screen(
    race: SharedProcess,
    configs: Mapping[str, Path],
    objective: str,
    options: Any,
    restart: Callable[[], SharedProcess],
    report: Callable[[str, Turn, float | None], None],
    slices: int | None = None,
    give_up: bool = True,
) -> tuple[Compared, ScreenWindows]:
    """The round's screen of `configs` (the control build first): the readings, and the executor
    (its `race`: the process the screen ended in, its `turns`). `report(label, turn, ratio)` once
    an arm's ratio is read; `give_up` false: no arm is read on its drain."""
    slices = slices or options.slices
    windows = ScreenWindows(
        race, configs, objective, options.window_s, options.floor, restart, slices, give_up
    )
    metric = windows.metric

    def progress(reading: comparison.Reading, so_far: Compared) -> None:
        before = so_far.readings[-2] if len(so_far.readings) > 1 else None
        if reading.label != policy.BASELINE or before is None or before.label == policy.BASELINE:
            return
        if not before.measurement.ends_turn:  # after the baseline window closing an arm's turn
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
            report(before.label, windows.turns[before.label], ratios.get(before.label))

    compared = comparison.compare(
        list(configs),
        policy.BASELINE,
        Budget(),
        FixedCount(1),
        windows,
        order=BRACKETED,
        turn=slices,
        report=progress,
    )
    return compared, windows


# A finalist's windows in its read over the baseline per screening window (20 by default).
FINAL_SLICES_PER_SCREEN_SLICE = 4


@dataclass
class Paired:
    """A finalist's read over the baseline: its paired speedup on each window metric, over the
    round's control build's (`control`) where one was read; its turn."""

    speedups: Mapping[str, Speedup | None]
    turn: Turn | None
    control: float | None = None

    def ratio(self, metric_name: str) -> float | None:
        read = self.read(metric_name)
        return None if read is None else read["ratio"]

    def read(self, metric_name: str) -> dict[str, Any] | None:
        """One metric's ratio over the control, its 95% interval and pairs."""
        speedup, scale = self.speedups.get(metric_name), self.control or 1.0
        if speedup is None:
            return None
        low, high = speedup.ci_low, speedup.ci_high
        return {
            "ratio": speedup.ratio / scale,
            "ci": None if low is None or high is None else [low / scale, high / scale],
            "pairs": speedup.n_pairs,
        }

    def to_json(self) -> dict[str, Any]:
        """What the study keeps: its windows, and each metric's `read`."""
        reads = {name: self.read(name) for name in self.speedups}
        windows = len(self.turn.slices) if self.turn else 0
        return {"windows": windows, **{k: v for k, v in reads.items() if v is not None}}


def read_over_baseline(
    race: SharedProcess,
    label: str,
    config: Path,
    objective: str,
    options: Any,
    restart: Callable[[], SharedProcess],
    control: float | None,
) -> tuple[Paired, SharedProcess]:
    """`config` read in FINAL_SLICES_PER_SCREEN_SLICE x race.slices windows between the
    baseline's; the read, and the race process it ended in."""
    slices = FINAL_SLICES_PER_SCREEN_SLICE * options.slices
    compared, windows = screen(
        race, {label: config}, objective, options, restart, lambda *_: None, slices, give_up=False
    )
    speedups = {m: window_ratio(compared, label, m) for m in Reading.metrics()}
    return Paired(speedups, windows.turns.get(label), control), windows.race


def over_baseline(
    result: TrialResult, baseline: Mapping[str, Any], paired: Paired
) -> tuple[TrialResult, dict[str, float]]:
    """`result` with each window metric the baseline's whole-trial value x the paired ratio
    (divided where lower is better); and the whole trial's own readings of those it replaced."""
    told: dict[str, float] = {}
    own: dict[str, float] = {}
    for name in Reading.metrics():
        base, measured, ratio = (
            baseline.get(name),
            getattr(result.metrics, name),
            paired.ratio(name),
        )
        if measured is None or not isinstance(base, (int, float)) or not ratio:
            continue
        told[name] = base * ratio if metrics.higher_is_better(name) else base / ratio
        own[name] = measured
    return replace(result, metrics=replace(result.metrics, **told)), own
