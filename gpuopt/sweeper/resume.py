"""Resuming a study: what a killed sweep left behind, and the writes that recover it.

A RUNNING trial whose owner (host, pid, start time: its system attrs) is gone on this host, whose
worker stopped beating (Optuna's heartbeat), or which never got an owner is failed and its params
enqueued again. A surplus trial (owners.is_surplus) is void (FAIL, never counted)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gpuopt.core._compat import (
    heartbeat_base,
    heartbeat_enabled,
    heartbeat_thread,
    stale_trial_ids,
    storage_of,
    trial_id,
    unwrap_storage,
)
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_FIXED_PARAMS,
    ATTR_GRID_ID,
    ATTR_INTERRUPTED,
    ATTR_OWNER,
    ATTR_REASON,
    ATTR_RERUN_OF,
    ATTR_SEARCH_SPACE,
    ATTR_STATUS,
    ATTR_VOID,
    STUDY_CONFIRM_CLAIM,
)
from gpuopt.sweeper import record
from gpuopt.sweeper.owners import live_claim, owner_alive, study_id, this_owner, worker_name

log = logging.getLogger("gpuopt.sweeper")
_STALE_CHECK = "the storage's stale check"  # Recovery's key beside the trial ids


def recover_interrupted(study: Any, trials: Sequence[Any] | None = None) -> list[int]:
    """Mark interrupted trials FAIL (reason recorded) and enqueue their params again."""
    from optuna.trial import TrialState

    return [
        t.number
        for t in _read(study, trials)
        if t.state == TrialState.RUNNING
        and owner_alive(t.system_attrs.get(ATTR_OWNER)) is False
        and fail_and_requeue(
            study,
            t,
            f"interrupted: the sweeping process {worker_name(t.system_attrs[ATTR_OWNER])} ended "
            "while this trial ran; its params were enqueued again",
        )
    ]


def fail_stale(study: Any, trials: Sequence[Any] | None = None) -> list[int]:
    """Fail the RUNNING trials whose worker stopped beating (Optuna's heartbeat) and re-queue them.

    The storage decides which are stale (always asked, never a snapshot); the reason is written
    before failing, since a finished trial's attrs cannot change any more."""
    storage = storage_of(study)
    if not isinstance(storage, heartbeat_base()) or not heartbeat_enabled(storage):
        return []
    stale = set(stale_trial_ids(storage, study_id(study)))
    if not stale:
        return []
    grace = getattr(unwrap_storage(storage), "grace_period", None)
    grace = grace or 2 * (storage.get_heartbeat_interval() or 0)
    found = [t for t in _read(study, trials) if trial_id(t) in stale]
    if len(found) < len(stale) and trials is not None:
        found = [t for t in study.get_trials(deepcopy=False) if trial_id(t) in stale]
    return [
        t.number
        for t in found
        if fail_and_requeue(
            study,
            t,
            f"interrupted: worker {worker_name(t.system_attrs.get(ATTR_OWNER))} sent no heartbeat "
            f"for over {grace} s (hydra.sweeper.grace_period) while this trial ran; its params "
            "were enqueued again",
        )
    ]


class Recovery:
    """This worker's recovery of dead workers' trials (`recover`), timed on its own clock (a trial's
    start time is its worker's clock) by one rule: act once a thing has waited its time since seen.

    A RUNNING trial that never got an owner (its worker died between `study.ask()` and its first
    heartbeat; RDBStorage's stale check only sees trials that beat once) is dead once ownerless for
    `grace_s`. The storage's stale check runs at once, then at most every `stale_every_s` (before
    every trial of a fast sweep it finds nothing new; a query each)."""

    def __init__(
        self,
        grace_s: float,
        stale_every_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace_s, self.stale_every_s = grace_s, stale_every_s
        self._clock = clock
        self._since: dict[int | str, float] = {_STALE_CHECK: -math.inf}  # first seen / last run

    def _waited(self, key: int | str, wait_s: float, now: float) -> bool:
        return now - self._since.setdefault(key, now) >= wait_s

    def fail_dead(self, study: Any, trials: Sequence[Any] | None = None) -> list[int]:
        """Fail the trials ownerless for grace_s."""
        from optuna.trial import TrialState

        now = self._clock()
        reason = (
            "interrupted: the worker that asked for this trial ended before it started (no owner "
            f"and no heartbeat for over {self.grace_s:g} s); its params were enqueued again"
        )
        return [
            t.number
            for t in _read(study, trials)
            if t.state == TrialState.RUNNING
            and ATTR_OWNER not in t.system_attrs
            and self._waited(trial_id(t), self.grace_s, now)
            and fail_and_requeue(study, t, reason)
        ]

    def recover(self, study: Any, trials: Sequence[Any] | None = None) -> bool:
        """Fail and re-queue trials whose worker died; whether it failed any (the study changed).

        `trials`: a snapshot read a moment ago is enough to find candidates (a dead worker's trial
        stays RUNNING, and failing one finished meanwhile does nothing); read again after a step
        failed some."""
        trials = _read(study, trials)
        steps: list[tuple[Callable[[Any, Sequence[Any]], list[int]], str]] = [
            (recover_interrupted, "a killed sweep on this host")
        ]
        now = self._clock()
        if self._waited(_STALE_CHECK, self.stale_every_s, now):
            self._since[_STALE_CHECK] = now
            steps.append((fail_stale, "a worker whose heartbeat stopped"))
        if heartbeat_enabled(storage_of(study)):
            steps.append((self.fail_dead, "a worker that died right after asking"))
        changed = False
        for step, cause in steps:
            numbers = step(study, trials)
            if numbers:
                changed = True
                trials = study.get_trials(deepcopy=False)
                log.warning(
                    "trials %s were interrupted by %s: marked FAIL, their params enqueued again",
                    numbers,
                    cause,
                )
        return changed


def fail_and_requeue(study: Any, trial: Any, reason: str) -> bool:
    """FAIL a RUNNING trial with `reason` and enqueue its params again, once across workers:
    the storage lets exactly one worker move it to FAIL, and only that one enqueues the re-run."""

    failed = {ATTR_STATUS: "error", ATTR_REASON: reason, ATTR_INTERRUPTED: True}
    if not record.fail_trial(study, trial, failed):
        return False  # another worker got there first
    attrs: dict[str, Any] = {ATTR_RERUN_OF: trial.number}
    if trial.user_attrs.get(ATTR_BASELINE):
        attrs[ATTR_BASELINE] = True
    # A trial that died before its params were suggested keeps the ones it was enqueued with.
    fixed = {**(trial.system_attrs.get(ATTR_FIXED_PARAMS) or {}), **trial.params}
    system_attrs: dict[str, Any] = {ATTR_FIXED_PARAMS: fixed}
    for key in (ATTR_GRID_ID, ATTR_SEARCH_SPACE):  # GridSampler: the same grid point, re-run
        if key in trial.system_attrs:
            system_attrs[key] = trial.system_attrs[key]
    record.add_waiting_trial(study, system_attrs, attrs)
    return True


def void(study: Any, trial: Any, why: str) -> None:
    """A trial that was asked but must not run (surplus, duplicate baseline): FAIL, never counted."""
    attrs = {ATTR_VOID: why, ATTR_STATUS: "void", ATTR_REASON: f"not run: {why}"}
    record.fail_trial(study, trial, attrs)


def claim_confirmation(study: Any, after_trials: int) -> bool:
    """Whether this worker runs the confirmation round for a study of `after_trials` trials.

    Each finishing worker writes a claim, waits a second and reads it back: the last writer wins.
    Best effort (no compare-and-set): at worst two workers confirm, costing time, not correctness."""
    current = live_claim(study, after_trials)
    if current is not None:
        return current.get("owner") == this_owner()
    storage, sid = storage_of(study), study_id(study)
    mine = {"owner": this_owner(), "after_trials": after_trials}
    record.study_system_attr(storage, sid, STUDY_CONFIRM_CLAIM, mine)
    time.sleep(1.0)
    return storage.get_study_system_attrs(sid).get(STUDY_CONFIRM_CLAIM) == mine


def fail_own_running(study: Any, reason: str) -> list[int]:
    """Mark this worker's RUNNING trials interrupted and re-queue their params (Ctrl-C,
    SIGTERM, SIGHUP): what the next resume would do, done at once."""
    from optuna.trial import TrialState

    owner = this_owner()
    return [
        t.number
        for t in study.get_trials(deepcopy=False)
        if t.state == TrialState.RUNNING
        and t.system_attrs.get(ATTR_OWNER) == owner
        and fail_and_requeue(study, t, reason)
    ]


class FinishedElsewhere:
    """Whether a trial this worker runs was failed as stale by another worker meanwhile (this
    one was paused: Ctrl-Z, SIGSTOP, a VM pause). The launcher asks while it waits (`reason(slot)`);
    the storage is read at most every `interval_s` seconds."""

    def __init__(
        self,
        study: Any,
        trials: Sequence[Any],
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._storage, self._ids = storage_of(study), [trial_id(t) for t in trials]
        self._numbers = [t.number for t in trials]
        self._interval, self._clock = interval_s, clock
        self._next = clock() + interval_s
        self._done: set[int] = set()

    def reason(self, slot: int) -> str | None:
        from optuna.trial import TrialState

        if slot not in self._done and self._clock() >= self._next:
            self._next = self._clock() + self._interval
            for k, tid in enumerate(self._ids):
                if self._storage.get_trial(tid).state != TrialState.RUNNING:
                    self._done.add(k)
        if slot not in self._done:
            return None
        return (
            f"trial #{self._numbers[slot]} was failed as stale by another worker while this one "
            "sent no heartbeat (paused for over hydra.sweeper.grace_period?): its process was "
            "stopped here; its params were re-queued"
        )


@contextlib.contextmanager
def beating(study: Any, trials: Sequence[Any]) -> Iterator[None]:
    """The trials' heartbeats while they run; when the sweep stops (a bad custom_search_space, a
    storage error) none of them may stay RUNNING, or every later run would find them in flight."""
    beats = [heartbeat_thread(t, storage_of(study)) for t in trials]
    for beat in beats:
        beat.start()  # records a beat at once, then every heartbeat_interval seconds
    try:
        yield
    except Exception as exc:
        fail_unfinished(study, trials, f"the sweep stopped: {type(exc).__name__}: {exc}")
        raise
    finally:
        for beat in beats:
            beat.join()


def fail_unfinished(study: Any, trials: Sequence[Any], reason: str) -> None:
    """FAIL every trial of `trials` still RUNNING (best effort: the sweep is stopping already)."""
    for trial in trials:
        try:
            record.fail_trial(study, trial, {ATTR_STATUS: "error", ATTR_REASON: reason})
        except Exception as exc:  # the storage itself may be what failed
            log.warning("could not mark trial #%d failed: %s", trial.number, exc)


def _read(study: Any, trials: Sequence[Any] | None) -> Sequence[Any]:
    return study.get_trials(deepcopy=False) if trials is None else trials


def exit_interrupted(study: Any, what: str) -> None:
    """A sweep stopped by Ctrl-C, SIGTERM or SIGHUP: running trials marked interrupted,
    one line on stderr, the signal's exit status."""
    import sys

    numbers: list[int] = []
    reason = (
        f"interrupted: the sweep was stopped ({what}) while this trial ran; its params were "
        "enqueued again"
    )
    try:
        if study is not None:
            numbers = fail_own_running(study, reason)
    except Exception as exc:  # the storage may be mid-transaction: the next resume recovers
        log.debug("could not mark trials interrupted: %s", exc)
    marked = f"trial(s) {numbers} marked interrupted, params re-queued; " if numbers else ""
    print(
        f"gpuopt: sweep stopped ({what}): {marked}run the same command to resume",
        file=sys.stderr,
        flush=True,
    )
    sys.exit({"signal SIGTERM": 143, "signal SIGHUP": 129}.get(what, 130))
