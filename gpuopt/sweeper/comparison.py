"""The one comparison service: is each arm faster than a control, beyond noise?

`compare(arms, control, budget, stop, executor)` measures the arms interleaved around a control and
returns every reading with each arm's ratio over the control and its interval. Every comparison
gpuopt makes is a call of it (its callers: docs/architecture.md).

Orders. "rounds": A B1 B2, then B2 B1 A (`round_order`), an arm paired with the control of its
round. "bracketed": B c1 B c1 B c2 ..., an arm's reading paired with the geometric mean of the
control readings either side of it, `turn` readings of an arm in a row. Either way the machine's
drift cancels within a pair. Why short readings: a 2-core VM's speed moves from one second to the
next (back-to-back 0.8 s windows of one build: 0.89-1.20x their median, steal 0%), so a pair is
as good as it is close in time: identical builds read at a log-sd of 0.098 in 1 s windows, 0.026
in 0.1 s slices (scripts/bench_slices.py, docs/benchmarks.md "Slicing the screen").

The service records nothing and writes no file: its callers store what it returns.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Protocol

from gpuopt.core.host import cpu_ticks, steal_percent
from gpuopt.core.stats import (
    DEFAULT_TARGET,
    LEVEL,
    Speedup,
    log_ratios,
    mean_interval,
    speedup,
)
from gpuopt.core.stats import stein_pairs as _stein_pairs

log = logging.getLogger("gpuopt.sweeper")

ROUNDS, BRACKETED = "rounds", "bracketed"
_VALUE = attrgetter("value")  # a reading's compared value


@dataclass(frozen=True)
class Measurement:
    """One measurement: `status` "ok" with `value`, or how it ended (oom, error, slow, ...);
    `detail`: the executor's own answer, kept for the caller; `last`: the arm's turn ends here."""

    status: str
    value: float | None = None
    detail: Any = None
    last: bool = False

    @property
    def ends_turn(self) -> bool:
        return self.last or self.status != "ok"

    @classmethod
    def of(cls, outcome: Any) -> Measurement:
        """A TrialOutcome as a measurement of its first value."""
        ok = outcome.feasible and outcome.values
        value = float(outcome.values[0]) if ok else None
        return cls("ok" if ok else outcome.status, value, outcome)


@dataclass(frozen=True)
class Reading:
    """One measurement as the comparison ran it (`job`: its index among the comparison's runs)."""

    label: str
    round: int
    job: int
    measurement: Measurement

    @property
    def value(self) -> float | None:
        return self.measurement.value if self.measurement.status == "ok" else None


class Executor(Protocol):
    """Measures `label` once as run `job`; `so_far`: what was measured before (a screen reads a
    just-built arm against the control's last window)."""

    def __call__(self, label: str, job: int, so_far: Compared) -> Measurement: ...


@dataclass(frozen=True)
class Budget:
    """At most `max_runs` measurements (None: no cap); a round that would pass it is not started,
    so pairs stay whole."""

    max_runs: int | None = None


@dataclass
class Compared:
    """The readings in the order they ran."""

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
        self, reading: Reading, value: Callable[[Reading], float | None] = _VALUE
    ) -> tuple[float | None, float | None]:
        """The control's `value`s just before and just after `reading` in run order."""
        i = self.readings.index(reading)
        before, after = (
            value(self.readings[j])
            if 0 <= j < len(self.readings) and self.readings[j].label == self.control
            else None
            for j in (i - 1, i + 1)
        )
        return before, after

    def ratio(
        self,
        label: str,
        direction: str,
        target: float = DEFAULT_TARGET,
        first_stage: int | None = None,
        value: Callable[[Reading], float | None] = _VALUE,
    ) -> Speedup | None:
        """The arm's paired speedup over the control (> 1: better), None without a pair. In round
        order pairs are rounds (`first_stage`: Stein's interval); in bracketed order each reading
        is paired with its neighbours' geometric mean, on `value` (the race reads each metric)."""
        if self.order == BRACKETED:  # "rounds" numbered by reading
            own = self.of(label)
            arm = dict(enumerate(value(r) for r in own))
            brackets = dict(enumerate(_geomean(self.neighbours(r, value)) for r in own))
            return paired_speedup(arm, brackets, direction, target)  # type: ignore[arg-type]
        return paired_speedup(
            self.by_round(label), self.by_round(self.control), direction, target, first_stage
        )


def paired_speedup(
    arm: Mapping[int, float],
    reference: Mapping[int, float],
    direction: str,
    target: float = DEFAULT_TARGET,
    first_stage: int | None = None,
    level: float = LEVEL,
) -> Speedup | None:
    """gpuopt.core.stats.speedup of two arms' values by round; `first_stage` (the rounds run
    before the count was chosen) counted in pairs. None without one pair."""
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
            level=level,
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
    """After a first stage of `first` rounds, Stein's count of pairs for a `level` interval of
    +-`target` (reported as Stein's interval: its coverage holds after the count was chosen from
    the first stage's spread); an arm the first stage shows slower than another leaves."""

    direction: str
    target: float
    first: int
    # arms that may be an answer of their own: only one of these beats another of these
    protected: frozenset[str] = frozenset()
    level: float = LEVEL

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
        """Total rounds for `arm` (no more when fewer than 2 pairs were measured: the runs fail);
        whole A B / B A cycles."""
        d = self._log_ratios(compared, arm, compared.control)
        if len(d) < 2:
            return self.first
        n = _stein_pairs(mean_interval(d)[2], len(d), math.asinh(self.target), self.level)
        return self.first + (n - len(d)) + (n - len(d)) % 2

    def beaten(self, compared: Compared) -> dict[str, str]:
        """The arms whose first-stage log-ratio interval lies below 0 against another one, with
        who beats it: such an arm cannot be the answer. A protected arm (a same-training
        candidate: it may be that answer) is only beaten by another protected one."""
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
                mean, half, _ = mean_interval(d, self.level)
                if mean + half < 0.0:
                    out[arm] = rival
                    break
        return out

    def _log_ratios(self, compared: Compared, arm: str, reference: str) -> list[float]:
        a, b = compared.by_round(arm), compared.by_round(reference)
        rounds = range(self.first)
        return log_ratios([a.get(r) for r in rounds], [b.get(r) for r in rounds], self.direction)


def round_order(labels: Sequence[str], round_index: int) -> list[str]:
    """A B1 B2 in even rounds, B2 B1 A in odd ones: in a fixed order a benchmark read -13% in 5 of
    5 rounds between two timings that agreed within 1.1% once the order alternated
    (docs/benchmarks.md)."""
    return list(labels) if round_index % 2 == 0 else list(reversed(labels))


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
    """Measure `arms` around `control`: `stop.first` rounds of every arm, then as many as
    `stop.wanted` gives each, while the budget allows a whole round; `report` after each reading."""
    compared = Compared(control, tuple(arms), order)
    wanted = dict.fromkeys(arms, stop.first)
    ticks = cpu_ticks()
    while active := [a for a in arms if compared.rounds < wanted[a]]:
        if order == BRACKETED:  # B c1 B c1 B c2 ...: an arm's turn ends early on `ends_turn`
            labels = [control, *[x for a in active for x in (a, control) * turn]]
        else:
            labels = round_order([control, *active], compared.rounds)
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


def calibrated(
    ratios: Mapping[str, float | None], by: str
) -> tuple[dict[str, float | None], float | None]:
    """(the other arms' ratios over arm `by`'s, `by`'s own ratio; as they are where `by` has
    none): `by` is the control's configuration built again (the race's policy.CONTROL)."""
    own = ratios.get(by)
    out = {label: r for label, r in ratios.items() if label != by}
    if own is None or own <= 0:
        return out, None
    return {label: None if r is None else r / own for label, r in out.items()}, own


def _geomean(values: Sequence[float | None]) -> float | None:
    sides = [v for v in values if v is not None and v > 0]
    return math.exp(math.fsum(math.log(v) for v in sides) / len(sides)) if sides else None
