"""This run's progress through the study: the line logged per trial, and the failure-rate stop."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from gpuopt.study import storage as storage_mod
from gpuopt.study.keys import ATTR_REASON
from gpuopt.study.rules import leading_trial
from gpuopt.sweeper.objectives import TrialOutcome
from gpuopt.sweeper.summary import progress_line

MIN_TRIALS_FOR_FAILURE_RATE = 3


class SweepAborted(RuntimeError):
    """Too many trials ended with status `error` (hydra.sweeper.max_failure_rate)."""


@dataclass
class Progress:
    """Finished trials of this run, the best so far, and the time per trial (for the ETA)."""

    n_trials: int
    names: list[str]
    directions: list[str]
    done_before: int  # counted trials of the study when this run started
    t_start: float  # when the sweep started
    t_loop: float = field(default_factory=time.monotonic)  # when the trials started
    best: tuple[int, list[float]] | None = None
    finished: int = 0
    errors: int = 0

    def start(self, trials: Any) -> None:
        """Read the study's best so far once; then it is kept up to date from this run's trials."""
        leader = leading_trial(trials, self.directions)
        self.best = (leader.number, leader.values) if leader is not None else None

    def record(self, number: int, baseline: bool, outcome: TrialOutcome) -> str:
        """Count one finished trial; the progress line to log."""
        sign = 1 if self.directions[0] == "maximize" else -1
        if (
            outcome.feasible
            and outcome.values
            and (self.best is None or sign * outcome.values[0] > sign * self.best[1][0])
        ):
            self.best = (number, outcome.values)
        self.finished += 1
        self.errors += outcome.failed
        done = self.done_before + self.finished
        per_trial = (time.monotonic() - self.t_loop) / self.finished
        return progress_line(
            done,
            self.n_trials,
            number,
            outcome.status,
            self.names,
            outcome.values,
            time.monotonic() - self.t_start,
            per_trial * max(0, self.n_trials - done),
            self.best,
            baseline,
            outcome.user_attrs.get(ATTR_REASON),
        )

    def check_failure_rate(self, max_failure_rate: float, study_name: str, storage: str) -> None:
        """SweepAborted once more than max_failure_rate of the finished trials (from the 3rd on)
        ended with status error; `storage` as it may be shown."""
        errors, finished = self.errors, self.finished
        if (
            errors
            and finished >= min(MIN_TRIALS_FOR_FAILURE_RATE, self.n_trials)
            and errors / finished > max_failure_rate
        ):
            raise SweepAborted(
                f"{errors} of {finished} trials ended with status error (> hydra.sweeper.max_failure_rate="
                f"{max_failure_rate}); see their 'reason' user attrs: optuna trials --study-name "
                f"{study_name} --storage {storage}"
            )


def log_start(
    study: Any,
    url: str | None,
    sampler: Any,
    names: list[str],
    directions: list[str],
    done_before: int,
    n_trials: int,
) -> None:
    """The sweep's opening lines (the stock sweeper's `Study name`, `Storage`, `Sampler`,
    `Directions` among them: scripts parse them)."""
    log = logging.getLogger("gpuopt.sweeper")
    if done_before:
        log.info(
            "study %r has %d/%d counted trials: resuming", study.study_name, done_before, n_trials
        )
    log.info("Study name: %s", study.study_name)
    log.info("Storage: %s", storage_mod.display(url))
    log.info("Sampler: %s", type(sampler).__name__)
    log.info("Directions: %s", directions)  # the stock sweeper's line
    log.info(
        "Objectives: %s", ", ".join(f"{n} ({d})" for n, d in zip(names, directions, strict=False))
    )
