"""The confirmation's record, typed: the study user attr `STUDY_CONFIRMATION` as the end-of-sweep
re-measurement stored it (gpuopt.sweeper.record writes `to_attr`); every reader reads this object,
never the stored dict. Reading is tolerant of earlier versions' records: a key one lacks reads as
None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuopt.study.keys import STUDY_CONFIRMATION

# How the confirmation measured (the record's `mode`).
FRESH_PROCESSES = "fresh processes"
IN_PROCESS = "in-process windows"


@dataclass
class ConfirmedConfig:
    """One configuration of the confirmation: the trial it comes from and its re-measurements,
    round by round (the rounds fill it in as they run)."""

    label: str  # "baseline", "candidate1", ...
    trial_number: int
    params: dict[str, Any]
    overrides: list[str]
    confirm_values: list[float] = field(default_factory=list)
    confirm_statuses: list[str] = field(default_factory=list)
    # round of each confirm_values entry (empty: value i is round i); a failed run has no value
    confirm_rounds: list[int] = field(default_factory=list)
    same_training: bool = False  # keeps the baseline's training math (rules.same_training)

    def by_round(self) -> dict[int, float]:
        rounds = self.confirm_rounds or range(len(self.confirm_values))
        return dict(zip(rounds, self.confirm_values, strict=False))

    @classmethod
    def from_attr(cls, entry: Mapping[str, Any]) -> ConfirmedConfig:
        lists = ("overrides", "confirm_values", "confirm_statuses", "confirm_rounds")
        return cls(
            label=entry.get("label"),
            trial_number=entry.get("trial_number"),
            params=dict(entry.get("params") or {}),
            same_training=bool(entry.get("same_training")),
            **{key: list(entry.get(key) or []) for key in lists},
        )


@dataclass(frozen=True)
class Comparison:
    """One stored speedup (gpuopt.core.stats.Speedup, and what was seen while measuring it): a
    candidate vs the baseline, or the top two vs each other (`labels`). `ratio` None: `error`."""

    label: str | None = None
    trial_number: int | None = None
    labels: tuple[str, ...] = ()
    ratio: float | None = None
    ci_low: float | None = None  # None: fewer than 2 pairs
    ci_high: float | None = None
    n_candidate: int | None = None
    n_reference: int | None = None
    n_pairs: int | None = None  # None: a record from before the pairing
    log_sd: float | None = None
    halfwidth: float | None = None  # relative half-width of the CI
    verdict: str | None = None  # faster | slower | same | too noisy (gpuopt.core.stats.verdict)
    pairs_needed: int | None = None
    level: float = 0.95  # the CI's confidence (records before it was stored: 95%)
    distinguishable: bool | None = None  # the CI excludes 1.0x; None without a CI
    error: str | None = None
    # Seen while measuring, for a "too noisy" verdict: the target, the 1-min load range and the
    # CPUs it ran on, the CPU time the hypervisor took (%).
    target_halfwidth: float | None = None
    load_1m: tuple[float, float] | None = None
    cpus: int | None = None
    steal_pct: float | None = None

    @classmethod
    def from_attr(cls, entry: Mapping[str, Any]) -> Comparison:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in entry.items() if k in names}
        values["labels"] = tuple(str(x) for x in values.get("labels") or ())
        load = values.get("load_1m")
        values["load_1m"] = (
            tuple(load) if isinstance(load, list | tuple) and len(load) == 2 else None
        )
        return cls(**values)

    @property
    def ci_name(self) -> str:
        """The interval as the summary and the report name it: "95% CI", "98% CI"."""
        return f"{100 * self.level:.0f}% CI"

    @property
    def measured(self) -> bool:
        """A speedup was computed (at least one pair)."""
        return isinstance(self.ratio, int | float)

    @property
    def faster(self) -> bool:
        """Above 1.0x and, where there is an interval, one that excludes 1.0x."""
        return (self.ratio or 0.0) > 1.0 and self.distinguishable is not False


@dataclass(frozen=True)
class Confirmation:
    """The confirmation record: how it ran, its configurations (the baseline first) and its
    verdicts."""

    configs: tuple[ConfirmedConfig, ...]
    comparisons: tuple[Comparison, ...]  # each candidate vs the baseline
    top_two: Comparison | None = None  # the two best candidates vs each other (>= 2 candidates)
    objective: str | None = None
    direction: str | None = None
    mode: str | None = None  # FRESH_PROCESSES | IN_PROCESS; None: before the in-process mode
    window_s: float | None = None  # IN_PROCESS: the window's length
    rounds: int | None = None  # rounds run (the first stage and the second)
    first_stage: int | None = None
    top_k: int | None = None
    after_trials: int | None = None  # counted trials of the study when it ran (final for them)
    # Stored for a reader of the study (gpuopt reads none): the runs it made of the most it
    # planned, the overrides of its lean runs (fresh processes), when it ran, the sweep's folder.
    runs: int | None = None
    max_runs: int | None = None
    lean_overrides: tuple[str, ...] = ()
    time: str | None = None
    sweep_dir: str | None = None
    # Read, not stored: the configs carry same_training flags (the two answers; a record of this
    # version always does).
    same_training_flagged: bool = False

    @classmethod
    def from_attr(cls, value: Any) -> Confirmation | None:
        """The record of a stored attr; None when it is not one (no list of comparisons)."""
        if not isinstance(value, Mapping) or not isinstance(value.get("comparisons"), list):
            return None
        configs = [c for c in value.get("configs") or [] if isinstance(c, Mapping)]
        top_two = value.get("top_two")
        special = {"configs", "comparisons", "top_two", "lean_overrides", "same_training_flagged"}
        plain = {f.name for f in dataclasses.fields(cls)} - special
        return cls(
            configs=tuple(ConfirmedConfig.from_attr(c) for c in configs),
            comparisons=tuple(
                Comparison.from_attr(e) for e in value["comparisons"] if isinstance(e, Mapping)
            ),
            top_two=Comparison.from_attr(top_two) if isinstance(top_two, Mapping) else None,
            lean_overrides=tuple(value.get("lean_overrides") or ()),
            same_training_flagged=bool(configs) and "same_training" in configs[0],
            **{name: value.get(name) for name in plain},
        )

    def to_attr(self) -> dict[str, Any]:
        """The stored record: every field but what is read from it (`same_training_flagged`)."""
        record = dataclasses.asdict(self)
        del record["same_training_flagged"]
        return record

    @property
    def baseline_number(self) -> int | None:
        return self.configs[0].trial_number if self.configs else None

    def comparison_of(self, number: int | None) -> Comparison | None:
        """Trial `number`'s verdict against the baseline, if it was a candidate."""
        return next((c for c in self.comparisons if c.trial_number == number), None)

    @property
    def winner(self) -> int | None:
        """The confirmed winner: the fastest candidate measurably faster than the baseline, else
        the baseline; None for a record without configs."""
        return self._fastest(self.comparisons)

    @property
    def same_training_winner(self) -> int | None:
        """`winner` among the candidates flagged same_training; None for a record without flags."""
        if not self.same_training_flagged:
            return None
        same = {c.trial_number for c in self.configs[1:] if c.same_training}
        return self._fastest([c for c in self.comparisons if c.trial_number in same])

    def _fastest(self, comparisons: Any) -> int | None:
        if not self.configs:
            return None
        faster = [c for c in comparisons if c.faster]
        if not faster:
            return self.baseline_number
        return max(faster, key=lambda c: c.ratio).trial_number


def read_confirmation(study_attrs: Mapping[str, Any]) -> Confirmation | None:
    """The study's confirmation (its user attrs), or None when it has none gpuopt can read."""
    return Confirmation.from_attr(study_attrs.get(STUDY_CONFIRMATION))
