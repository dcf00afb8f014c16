"""The one comparison service: is each arm faster than a control, beyond noise?

`compare(arms, control, budget, stop, executor)` measures the arms interleaved around a control and
returns every reading with each arm's ratio over the control and its interval. Every comparison
gpuopt makes is a call of it with its own settings:

| caller                      | order     | stop                       | executor                    |
|-----------------------------|-----------|----------------------------|-----------------------------|
| the race's screen           | bracketed, turn race.slices | FixedCount(1) | race/screen.ScreenWindows |
| a race finalist's read      | bracketed, turn 4x that | FixedCount(1)  | race/screen.ScreenWindows   |
| the in-process confirmation | rounds    | PairStop (Stein, two-stage)| one window of SharedProcess |
| the fresh-process one       | rounds    | PairStop                   | a run of the sweep's launcher|

Orders. "rounds": each round measures the control and every arm still in, A B1 B2 in even rounds
and B2 B1 A in odd ones (`round_order`), an arm's reading paired with the control's of its round.
"bracketed": the control between every two arms' readings, an arm's reading paired with the
geometric mean of the control readings on either side of it; an arm's `turn` is that many short
readings in a row, each between two of the control's (B c1 B c1 B c1 B c2 ...). Either way the
machine's drift cancels within a pair, and the ratio is the paired estimator of
gpuopt.core.stats.speedup. Why short readings: a 2-core VM's speed moves from one second to the
next (one process, one build, back-to-back 0.8 s windows: 0.89-1.20x their median, steal 0%), so
a pair is as good as it is close in time: 1 s of an arm against 1 s of its control read identical
builds at a log-sd of 0.098 as one window each, 0.026 in 0.1 s slices (scripts/bench_slices.py,
docs/benchmarks.md "Slicing the screen").

The service records nothing in Optuna and writes no file: a caller stores what it returns (the
confirmation's record, the race's trials through the trial loop).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuopt.core.host import cpu_ticks, steal_percent
from gpuopt.core.stats import DEFAULT_TARGET, Speedup, log_ratios, mean_interval, speedup
from gpuopt.core.stats import stein_pairs as _stein_pairs

log = logging.getLogger("gpuopt.sweeper")

ROUNDS, BRACKETED = "rounds", "bracketed"


@dataclass(frozen=True)
class Measurement:
    """What an executor gives back for one measurement: `status` "ok" with the compared `value`,
    or how it ended (oom, error, slow, ...) and no value; `detail`: the executor's own answer (a
    window's reading, a trial's outcome), kept for the caller. `last`: the executor has no more
    readings of this arm in its turn (the screen's arm read on its drain); a failed one has none
    either."""

    status: str
    value: float | None = None
    detail: Any = None
    last: bool = False

    @property
    def ends_turn(self) -> bool:
        return self.last or self.status != "ok"

    @classmethod
    def of(cls, outcome: Any) -> Measurement:
        """A TrialOutcome (a fresh-process run, a shared-process window) as a measurement of
        its first value."""
        ok = outcome.feasible and outcome.values
        value = float(outcome.values[0]) if ok else None
        return cls("ok" if ok else outcome.status, value, outcome)


@dataclass(frozen=True)
class Reading:
    """One measurement as the comparison ran it: which arm (or the control), in which round, the
    how-manieth run of the comparison (`job`)."""

    label: str
    round: int
    job: int
    measurement: Measurement

    @property
    def value(self) -> float | None:
        return self.measurement.value if self.measurement.status == "ok" else None


def _value(reading: Reading) -> float | None:
    return reading.value


class Executor(Protocol):
    """Measures `label` once as run `job` of the comparison; may read what was measured so far
    (`so_far`: a screen reads a just-built arm against the control's last window)."""

    def __call__(self, label: str, job: int, so_far: Compared) -> Measurement: ...


@dataclass(frozen=True)
class Budget:
    """At most `max_runs` measurements in all (None: no cap); a round that would pass it is not
    started, so pairs stay whole."""

    max_runs: int | None = None


@dataclass
class Compared:
    """The readings in the order they ran, and what they say."""

    control: str
    arms: tuple[str, ...]
    order: str
    readings: list[Reading] = field(default_factory=list)
    rounds: int = 0
    loads: list[float] = field(default_factory=list)  # the 1-min load average before each run
    steal_pct: float | None = None  # the hypervisor's share of the CPU over the runs (host.py)

    @property
    def runs(self) -> int:
        return len(self.readings)

    def of(self, label: str) -> list[Reading]:
        return [r for r in self.readings if r.label == label]

    def by_round(self, label: str) -> dict[int, float]:
        """The arm's values by round (a failed measurement: no entry)."""
        return {r.round: r.value for r in self.of(label) if r.value is not None}

    def neighbours(
        self, reading: Reading, value: Callable[[Reading], float | None] = _value
    ) -> tuple[float | None, float | None]:
        """The control's values just before and just after `reading` in run order (bracketed);
        `value`: which of a reading's values (its compared one by default)."""
        i = self.readings.index(reading)
        return self._control_value(i - 1, value), self._control_value(i + 1, value)

    def _control_value(self, index: int, value: Callable[[Reading], float | None]) -> float | None:
        if not 0 <= index < len(self.readings) or self.readings[index].label != self.control:
            return None
        return value(self.readings[index])

    def ratio(
        self,
        label: str,
        direction: str,
        over: str | None = None,
        target: float = DEFAULT_TARGET,
        first_stage: int | None = None,
        value: Callable[[Reading], float | None] = _value,
    ) -> Speedup | None:
        """The arm's paired speedup over the control (or another arm, `over`): > 1 is better
        whichever the direction, with its 95% interval from 2 pairs on. In round order pairs are
        rounds (`first_stage`: Stein's interval); in bracketed order an arm's reading is paired
        with the geometric mean of the control readings either side of it, on `value` (another
        of the executor's readings than the compared one: the race reads each window metric).
        None without a pair."""
        reference = over or self.control
        if self.order == BRACKETED and reference == self.control:
            own = self.of(label)
            brackets = [_geomean(self.neighbours(r, value)) for r in own]
            try:
                return speedup([value(r) for r in own], brackets, direction, target=target)
            except ValueError:
                return None
        return paired_speedup(
            self.by_round(label), self.by_round(reference), direction, target, first_stage
        )


def paired_speedup(
    arm: Mapping[int, float],
    reference: Mapping[int, float],
    direction: str,
    target: float = DEFAULT_TARGET,
    first_stage: int | None = None,
) -> Speedup | None:
    """gpuopt.core.stats.speedup of two arms' values by round, rounds missing either side left
    out; `first_stage` (the rounds run before the count was chosen) counted in pairs. None
    without one pair."""
    rounds = sorted(set(arm) | set(reference))
    if first_stage:
        first_stage = sum(1 for r in rounds if r < first_stage and r in arm and r in reference)
    try:
        return speedup(
            [arm.get(r) for r in rounds],
            [reference.get(r) for r in rounds],
            direction,
            target=target,
            first_stage=first_stage,
        )
    except ValueError:
        return None


class Stop(Protocol):
    """How many rounds each arm gets: `first` for all, then `wanted` once those ran."""

    first: int

    def wanted(self, compared: Compared) -> dict[str, int]: ...


@dataclass(frozen=True)
class FixedCount:
    """Every arm `first` rounds (the screen: one window each)."""

    first: int = 1

    def wanted(self, compared: Compared) -> dict[str, int]:
        return dict.fromkeys(compared.arms, self.first)


@dataclass(frozen=True)
class PairStop:
    """The sequential rule: after a first stage of `first` rounds, Stein's count of pairs for a
    95% interval of +-`target` (the interval reported is Stein's too: its coverage holds after
    the count was chosen from the first stage's spread); an arm the first stage already shows
    slower than another leaves (`beaten`)."""

    direction: str
    target: float
    first: int
    # arms that may be an answer of their own: only one of these beats another of these
    protected: frozenset[str] = frozenset()

    def wanted(self, compared: Compared) -> dict[str, int]:
        wanted = {arm: self.pairs(compared, arm) for arm in compared.arms}
        for label, by in self.beaten(compared).items():
            log.info("comparison: %s is slower than %s: no more rounds for it", label, by)
            wanted[label] = self.first
        log.info(
            "comparison: rounds wanted for +-%.0f%%: %s",
            100 * self.target,
            ", ".join(f"{k} {v}" for k, v in wanted.items()),
        )
        return wanted

    def pairs(self, compared: Compared, arm: str) -> int:
        """Total rounds for `arm`, from the spread of its first-stage pairs (no more when fewer
        than 2 were measured: the runs fail, more would not help); whole A B / B A cycles."""
        d = self._log_ratios(compared, arm, compared.control)
        if len(d) < 2:
            return self.first
        n = _stein_pairs(mean_interval(d)[2], len(d), math.asinh(self.target))
        return self.first + (n - len(d)) + (n - len(d)) % 2

    def beaten(self, compared: Compared) -> dict[str, str]:
        """The arms the first stage already shows slower than another one, each with who beats
        it: the 95% interval of their paired log-ratio lies below 0. Such an arm cannot be the
        answer, so its further rounds would only narrow an interval nobody acts on. A protected
        arm (a same-training candidate: it may be the same-training answer) is only beaten by
        another protected one."""
        out: dict[str, str] = {}
        for arm in compared.arms:
            rivals = [
                a
                for a in compared.arms
                if a != arm and (a in self.protected or arm not in self.protected)
            ]
            for rival in rivals:
                d = self._log_ratios(compared, arm, rival)
                if len(d) < 2:
                    continue
                mean, half, _ = mean_interval(d)
                if mean + half < 0.0:
                    out[arm] = rival
                    break
        return out

    def _log_ratios(self, compared: Compared, arm: str, reference: str) -> list[float]:
        a, b = compared.by_round(arm), compared.by_round(reference)
        rounds = range(self.first)
        return log_ratios([a.get(r) for r in rounds], [b.get(r) for r in rounds], self.direction)


def round_order(labels: Sequence[str], round_index: int) -> list[str]:
    """A B1 B2 in even rounds, B2 B1 A in odd ones, so a position effect (the first run of a
    round, or the one after a given config) does not favour one config. In a fixed order a
    benchmark read -13% in 5 of 5 rounds between two timings that agreed within 1.1% once the
    order alternated (docs/benchmarks.md). The benchmarks in scripts/ use the same order."""
    return list(labels) if round_index % 2 == 0 else list(reversed(labels))


def bracketed_order(control: str, arms: Sequence[str], turn: int = 1) -> list[str]:
    """B c1 B c2 ... B: a control measurement on each side of every arm's; each arm `turn`
    times in a row (B c1 B c1 B c2 B c2 B for 2). `compare` ends an arm's turn early where a
    measurement says so (`Measurement.ends_turn`)."""
    order = [control]
    for label in arms:
        order += [label, control] * turn
    return order


def compare(
    arms: Sequence[str],
    control: str,
    budget: Budget,
    stop: Stop,
    executor: Executor,
    *,
    order: str = ROUNDS,
    turn: int = 1,
    report: Callable[[Reading, Compared], None] | None = None,
    load: Callable[[], float] = lambda: os.getloadavg()[0],
) -> Compared:
    """Measure `arms` around `control`: `stop.first` rounds of every arm, then each arm for as
    many rounds as `stop.wanted` gives it, while the budget allows a whole round; in bracketed
    order each arm's `turn` readings in a row. `report` is called after each reading (a
    progress line)."""
    compared = Compared(control, tuple(arms), order)
    wanted = dict.fromkeys(arms, stop.first)
    ticks = cpu_ticks()
    while active := [a for a in arms if compared.rounds < wanted[a]]:
        labels = _round_labels(order, control, active, compared.rounds, turn)
        if budget.max_runs is not None and compared.runs + len(labels) > budget.max_runs:
            log.info("comparison: the run cap (%d) is reached", budget.max_runs)
            break
        ended: set[str] = set()  # arms whose turn a measurement ended
        skipped = False  # the last label was an ended arm's: its control window goes too
        for label in labels:
            if label in ended or (skipped and label == control):
                skipped = label in ended
                continue
            skipped = False
            compared.loads.append(load())
            measurement = executor(label, compared.runs, compared)
            reading = Reading(label, compared.rounds, compared.runs, measurement)
            compared.readings.append(reading)
            if label != control and measurement.ends_turn:
                ended.add(label)
            if report is not None:
                report(reading, compared)
        compared.rounds += 1
        if compared.rounds == stop.first:
            wanted = stop.wanted(compared)
    compared.steal_pct = steal_percent(ticks, cpu_ticks())
    return compared


def _round_labels(
    order: str, control: str, active: Sequence[str], index: int, turn: int
) -> list[str]:
    if order == BRACKETED:
        return bracketed_order(control, active, turn)
    return round_order([control, *active], index)


def calibrated(
    ratios: Mapping[str, float | None], by: str
) -> tuple[dict[str, float | None], float | None]:
    """(the other arms' ratios over arm `by`'s, `by`'s own ratio): where an arm that is the
    control's configuration built again reads the control's build effect (the race's
    policy.CONTROL); the ratios as they are where `by` has none."""
    own = ratios.get(by)
    out = {label: r for label, r in ratios.items() if label != by}
    if own is None or own <= 0:
        return out, None
    return {label: None if r is None else r / own for label, r in out.items()}, own


def _geomean(values: Sequence[float | None]) -> float | None:
    sides = [v for v in values if v is not None and v > 0]
    return math.exp(math.fsum(math.log(v) for v in sides) / len(sides)) if sides else None
