"""The study's progress, as one worker tells it: the line logged per trial, and the failure-rate stop.

Each line counts the study's finished trials (of every worker) and takes its ETA and best from the
study, so all workers tell one story. The failure-rate stop counts this worker's trials (the stock
sweeper's rule is per process too)."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuopt.core.secrets import mask_secrets
from gpuopt.study import storage as storage_mod
from gpuopt.study.keys import ATTR_OWNER, ATTR_REASON, ATTR_TRACEBACK
from gpuopt.study.rules import leading_trial
from gpuopt.sweeper import owners
from gpuopt.sweeper.objectives import TrialOutcome
from gpuopt.sweeper.summary import progress_line

MIN_TRIALS_FOR_FAILURE_RATE = 3
IN_MEMORY = storage_mod.display(None)  # how an in-memory study's storage is shown
TRACEBACK_TAIL_LINES = 15  # of the last failure's traceback, on stderr when the sweep stops


class SweepAborted(RuntimeError):
    """Too many trials ended with status `error` (hydra.sweeper.max_failure_rate); `failure`: the
    last failing trial's exception and the tail of its traceback, shown before the one line."""

    def __init__(self, message: str, failure: str = "") -> None:
        super().__init__(message)
        self.failure = failure


def failure_text(number: int, user_attrs: dict[str, Any], traceback: str | None = None) -> str:
    """A failed trial as the stock sweeper's re-raise shows it: its traceback's last lines (which
    end with `Type: message`), or its reason when it has no traceback; secrets masked."""
    reason = str(user_attrs.get(ATTR_REASON) or "error")
    tb = (traceback or user_attrs.get(ATTR_TRACEBACK) or "").rstrip()
    lines = tb.splitlines()[-TRACEBACK_TAIL_LINES:] if tb else []
    if lines and not lines[0].startswith("Traceback"):
        cut = "Traceback (most recent call last" in tb  # a long one, cut; else a log's tail
        label = "Traceback (most recent call last; its last lines):" if cut else "its log ends:"
        lines = [label, *lines]
    if not lines or reason not in tb:
        lines.append(reason)
    return mask_secrets(f"gpuopt: trial #{number} failed:\n" + "\n".join(lines))


def study_done(trials: Sequence[Any]) -> int:
    """The study's finished trials that count towards n_trials (owners.counted, not in flight)."""
    return sum(1 for t in trials if t.state.is_finished() and owners.counted(t))


@dataclass
class Progress:
    """The study's finished trials, its best so far and its pace (the ETA), as this worker sees
    them; this worker's own errors (the failure-rate stop)."""

    n_trials: int
    names: list[str]
    directions: list[str]
    t_start: float  # when the sweep started
    t_loop: float = field(default_factory=time.monotonic)  # when the trials started
    best: tuple[int, list[float]] | None = None
    finished: int = 0  # this worker's
    errors: int = 0  # this worker's
    last_failure: str = ""  # failure_text of this worker's last failed trial
    started_at: datetime.datetime = field(default_factory=datetime.datetime.now)  # Optuna's clock
    done_at_start: int | None = None  # the study's finished trials when the trials started
    me: str = field(default_factory=lambda: owners.worker_name(owners.this_owner()))
    several: bool = False  # another worker has worked on the study during this run

    def start(self, trials: Any) -> None:
        """Read the study's best and finished trials once, before this worker's trials."""
        leader = leading_trial(trials, self.directions)
        self.best = (leader.number, leader.values) if leader is not None else None
        self.done_at_start = study_done(trials)
        self.t_loop = time.monotonic()

    def record(
        self,
        number: int,
        baseline: bool,
        outcome: TrialOutcome,
        trials: Sequence[Any],
        traceback: str | None = None,
    ) -> str:
        """Count one finished trial of this worker; the progress line. `trials`: the study's trials
        after the tell."""
        self.finished += 1
        self.errors += outcome.failed
        if outcome.failed:
            self.last_failure = failure_text(number, outcome.user_attrs, traceback)
        done = study_done(trials)
        leader = leading_trial(trials, self.directions)
        self.best = (leader.number, leader.values) if leader is not None else None
        self.several = self.several or self._others_worked(trials)
        per_trial = (time.monotonic() - self.t_loop) / max(1, done - (self.done_at_start or 0))
        line = progress_line(
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
        return f"{line} | worker {self.me}" if self.several else line

    def _others_worked(self, trials: Sequence[Any]) -> bool:
        """Whether another worker ran a trial of the study since this worker started."""
        for t in trials:
            owner = t.system_attrs.get(ATTR_OWNER)
            if not owner or owners.worker_name(owner) == self.me:
                continue
            if t.datetime_complete is None or t.datetime_complete >= self.started_at:
                return True
        return False

    def check_failure_rate(
        self, max_failure_rate: float, study_name: str, storage: str | None
    ) -> None:
        """SweepAborted once more than max_failure_rate of the finished trials (from the 3rd
        on) ended with status error; `storage` None or "memory": the hint names none."""
        errors, finished = self.errors, self.finished
        if (
            errors
            and finished >= min(MIN_TRIALS_FOR_FAILURE_RATE, self.n_trials)
            and errors / finished > max_failure_rate
        ):
            if storage in (None, IN_MEMORY):
                where = (
                    "the study was in memory and is not kept (storage: null): each trial's log "
                    "is in its run dir (hydra.sweep.dir)"
                )
            else:
                where = (
                    "see their 'reason' user attrs: optuna trials --study-name "
                    f"{study_name} --storage {storage}"
                )
            raise SweepAborted(
                f"{errors} of {finished} trials ended with status error (> "
                f"hydra.sweeper.max_failure_rate={max_failure_rate}); {where}",
                self.last_failure,
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
