"""Resuming a study: which trials count towards n_trials, and what a killed sweep left behind.

Each trial records its owner (host, pid and process start time of the sweeping process) in its
system attrs. On start, a RUNNING trial whose owner is on this host and no longer alive
(`owner_alive`, on gpuopt.core.lifeline's one liveness check: a zombie or a reused pid is dead) was
interrupted: it is marked FAIL with the reason in its user attrs and its params are enqueued again,
so the configuration is re-measured rather than silently lost. Owners on other hosts are found
through Optuna's heartbeat (`fail_stale`): a RUNNING trial whose worker stopped beating for
`grace_period` seconds gets the same treatment, and so does one that never got an owner
(`OwnerlessWatch`: its worker died between `study.ask()` and its first heartbeat).

Several workers on one study (the same command, a shared storage) follow one counting rule, so the
study never ends with more than n_trials counted trials even when workers ask() at the same time:
a trial counts when it is finished (not interrupted, not void) or running under a live owner, and a
freshly asked trial may run only if fewer than n_trials counted-or-waiting trials have a *lower
number* (`is_surplus`). Trial numbers are handed out by the storage, so two racing workers never
both see the other ahead of themselves. A surplus trial is marked void (FAIL, user attr `void`),
never counted, and its worker stops. While other live workers still run trials
(`running_elsewhere`), this worker is not the last: it waits for them, and leaves the
confirmation round to whoever finishes last.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from gpuopt.core._compat import (
    heartbeat_base,
    heartbeat_enabled,
    stale_trial_ids,
    storage_of,
    trial_id,
    unwrap_storage,
)
from gpuopt.core.lifeline import process_alive, start_ticks
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

log = logging.getLogger("gpuopt.sweeper")


def host_name() -> str:
    """This worker's host as recorded on its trials. GPUOPT_HOSTNAME overrides it where hosts share
    a name (containers on several machines often all call themselves the same): pid checks are
    only made for trials of the same host name, the others rely on heartbeats."""
    return os.environ.get("GPUOPT_HOSTNAME") or socket.gethostname()


def this_owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": host_name(), "pid": pid, "start": start_ticks(pid)}


def owner_alive(owner: dict[str, Any] | None, host: str | None = None) -> bool | None:
    """True/False for an owner on this host (`lifeline.process_alive`: its pid runs, is not a
    zombie and started when recorded); None when it cannot be told (another host, no owner)."""
    if not isinstance(owner, dict) or owner.get("host") != (host or host_name()):
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return None
    return process_alive(pid, owner.get("start"))


def interrupted_trials(trials: Sequence[Any]) -> list[Any]:
    """RUNNING trials whose sweeping process on this host is gone."""
    from optuna.trial import TrialState

    return [
        t
        for t in trials
        if t.state == TrialState.RUNNING and owner_alive(t.system_attrs.get(ATTR_OWNER)) is False
    ]


def recover_interrupted(study: Any, trials: Sequence[Any] | None = None) -> list[int]:
    """Mark interrupted trials FAIL (reason recorded) and enqueue their params again. `trials`: the
    study's trials as read a moment ago (`recover`'s snapshot), None: read here."""
    recovered = []
    for trial in interrupted_trials(_read(study, trials)):
        owner = trial.system_attrs.get(ATTR_OWNER) or {}
        reason = (
            f"interrupted: the sweeping process {owner.get('host')}:{owner.get('pid')} ended while "
            "this trial ran; its params were enqueued again"
        )
        if fail_and_requeue(study, trial, reason):
            recovered.append(trial.number)
    return recovered


def fail_stale(study: Any, trials: Sequence[Any] | None = None) -> list[int]:
    """Fail the RUNNING trials whose worker stopped beating (Optuna's heartbeat) and re-queue them.

    The storage decides which trials are stale (`_compat.stale_trial_ids`, what
    `optuna.storages.fail_stale_trials` uses; always asked, never a snapshot); gpuopt writes the
    reason before failing the trial, since a finished trial's attrs cannot change any more.
    `trials`: the study's trials as read a moment ago, where the stale ones are looked up (read
    again when one is missing from it: a snapshot older than the trial).
    """
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
    recovered = []
    for trial in found:
        owner = trial.system_attrs.get(ATTR_OWNER) or {}
        reason = (
            f"interrupted: worker {owner.get('host')}:{owner.get('pid')} sent no heartbeat for "
            f"over {grace} s (hydra.sweeper.grace_period) while this trial ran; its params were "
            "enqueued again"
        )
        if fail_and_requeue(study, trial, reason):
            recovered.append(trial.number)
    return recovered


class OwnerlessWatch:
    """Fails RUNNING trials that never got an owner: their worker died between `study.ask()` and
    its first heartbeat. RDBStorage's stale check only sees trials that beat at least once, and a
    trial's start time comes from its worker's clock (another host, maybe another time zone), so
    this worker times them itself: one still ownerless `grace_s` after it first saw it is dead (a
    live worker writes the owner milliseconds after asking) and is failed and re-queued."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self._first_seen: dict[int, float] = {}

    def fail_dead(self, study: Any, trials: Sequence[Any] | None = None) -> list[int]:
        """Fail the trials ownerless for grace_s; `trials`: the study's trials as read a moment
        ago (None: read here)."""
        from optuna.trial import TrialState

        now = self._clock()
        ownerless = {
            trial_id(t): t
            for t in _read(study, trials)
            if t.state == TrialState.RUNNING and ATTR_OWNER not in t.system_attrs
        }
        self._first_seen = {tid: self._first_seen.get(tid, now) for tid in ownerless}
        reason = (
            "interrupted: the worker that asked for this trial ended before it started (no owner "
            f"and no heartbeat for over {self.grace_s:g} s); its params were enqueued again"
        )
        return [
            trial.number
            for tid, trial in ownerless.items()
            if now - self._first_seen[tid] >= self.grace_s
            and fail_and_requeue(study, trial, reason)
        ]


class StaleGate:
    """When this worker asks the storage for stale trials again: at once, then at most every
    `every_s` seconds. A stale trial is one that sent no heartbeat for grace_period (2 x
    heartbeat_interval by default), so asking before every trial of a fast sweep (a query each,
    on SQLite a few ms) finds nothing new; asking every half interval finds a dead worker's trial
    at most that much later than the grace period says."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last: float | None = None

    def due(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        return True


def fail_and_requeue(study: Any, trial: Any, reason: str) -> bool:
    """FAIL a RUNNING trial with `reason` and enqueue its params again, once across workers.

    Several workers may find the same dead trial: the storage lets exactly one of them move it to
    FAIL (the others get UpdateFinishedTrialError), and only that one enqueues the re-run.
    """

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


def counted(trial: Any) -> bool:
    """Whether a trial counts towards n_trials: finished, and not an interrupted one (re-run)."""
    from optuna.trial import TrialState

    if trial.state == TrialState.RUNNING:
        return owner_alive(trial.system_attrs.get(ATTR_OWNER)) is not False  # in flight elsewhere
    if trial.state == TrialState.WAITING:
        return False
    return not trial.user_attrs.get(ATTR_INTERRUPTED, False) and not trial.user_attrs.get(ATTR_VOID)


def is_surplus(number: int, trials: Sequence[Any], n_trials: int) -> bool:
    """Whether trial `number`, just asked, would exceed n_trials (the module docstring's rule).

    Ahead of it: lower-numbered trials that count, or are WAITING (being popped by another worker,
    or queued re-runs: they run before anything new).
    """
    from optuna.trial import TrialState

    ahead = sum(
        1 for t in trials if t.number < number and (counted(t) or t.state == TrialState.WAITING)
    )
    return ahead >= n_trials


def duplicate_baseline(number: int, trials: Sequence[Any]) -> bool:
    """Whether trial `number` is a baseline enqueued twice (two workers started at once)."""
    return any(
        t.number < number
        and t.user_attrs.get(ATTR_BASELINE)
        and not t.user_attrs.get(ATTR_INTERRUPTED)
        and not t.user_attrs.get(ATTR_VOID)
        for t in trials
    )


def running_elsewhere(trials: Sequence[Any]) -> list[Any]:
    """RUNNING trials that another live worker is measuring: not this worker's own, and not
    those of an owner known dead (this host: pid gone; other hosts: assumed alive until their
    heartbeat goes stale). While any remain, this worker is not the last one of the study."""
    from optuna.trial import TrialState

    me = this_owner()
    return [
        t
        for t in trials
        if t.state == TrialState.RUNNING
        and (owner := t.system_attrs.get(ATTR_OWNER)) != me
        and owner_alive(owner) is not False
    ]


def trials_to_go(trials: Sequence[Any], n_trials: int) -> int:
    return max(0, n_trials - sum(1 for t in trials if counted(t)))


def has_baseline(trials: Sequence[Any]) -> bool:
    """A baseline trial exists (finished, running, or waiting to be re-run)."""
    return any(
        t.user_attrs.get(ATTR_BASELINE)
        and not t.user_attrs.get(ATTR_INTERRUPTED)
        and not t.user_attrs.get(ATTR_VOID)
        for t in trials
    )


def claim_confirmation(study: Any, after_trials: int, settle_s: float = 1.0) -> bool:
    """Whether this worker runs the confirmation round for a study of `after_trials` trials.

    Workers that finish together each write a claim (study system attr), wait `settle_s` and read it
    back: the last writer wins. A live claim for the same trial count already there means another
    worker is confirming. Best effort (the storages have no compare-and-set): at worst two workers
    confirm, which costs time, not correctness (the record is overwritten, no trial is counted).
    """
    storage, sid = storage_of(study), study_id(study)
    current = storage.get_study_system_attrs(sid).get(STUDY_CONFIRM_CLAIM)
    if (
        isinstance(current, dict)
        and current.get("after_trials") == after_trials
        and owner_alive(current.get("owner")) is not False
    ):
        return current.get("owner") == this_owner()
    mine = {"owner": this_owner(), "after_trials": after_trials}
    record.study_system_attr(storage, sid, STUDY_CONFIRM_CLAIM, mine)
    time.sleep(settle_s)
    return storage.get_study_system_attrs(sid).get(STUDY_CONFIRM_CLAIM) == mine


_STUDY_IDS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def study_id(study: Any) -> int:
    """The storage's id of a study, by the public name lookup (Study keeps its id private); looked
    up once per Study object, as Study itself does in its constructor (the heartbeat check asked
    for it between every two batches: one storage query per trial)."""
    sid = _STUDY_IDS.get(study)
    if sid is None:
        sid = _STUDY_IDS[study] = storage_of(study).get_study_id_from_name(study.study_name)
    return sid


def fail_own_running(study: Any, reason: str) -> list[int]:
    """Mark this worker's RUNNING trials interrupted (FAIL, reason) and re-queue their params: what
    the next resume would do, done at once when the sweep is stopped (Ctrl-C, SIGTERM, SIGHUP)."""
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
    """Whether a trial this worker runs was finished by someone else meanwhile: another worker
    failed it as stale because this one sent no heartbeat for grace_period (it was paused: Ctrl-Z,
    SIGSTOP, a VM pause) and re-queued its params. The launcher asks while it waits for the trial
    (`reason(slot)`); the storage is read at most every `interval_s` seconds."""

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

    def seen(self, slot: int) -> bool:
        """Whether a read of `finished` already found the trial finished elsewhere (no read)."""
        return slot in self._done

    def finished(self, slot: int) -> bool:
        from optuna.trial import TrialState

        if slot not in self._done and self._clock() >= self._next:
            self._next = self._clock() + self._interval
            for k, tid in enumerate(self._ids):
                if self._storage.get_trial(tid).state != TrialState.RUNNING:
                    self._done.add(k)
        return slot in self._done

    def reason(self, slot: int) -> str | None:
        if not self.finished(slot):
            return None
        return (
            f"trial #{self._numbers[slot]} was failed as stale by another worker while this one "
            "sent no heartbeat (paused for over hydra.sweeper.grace_period?): its process was "
            "stopped here; its params were re-queued"
        )


def fail_unfinished(study: Any, trials: Sequence[Any], reason: str) -> None:
    """FAIL every trial of `trials` still RUNNING, with the reason (best effort: the sweep is
    stopping on an error already)."""
    import optuna

    for trial in trials:
        try:
            frozen = storage_of(study).get_trial(trial_id(trial))
            if frozen.state != optuna.trial.TrialState.RUNNING:
                continue
            record.fail_running(study, trial, reason)
        except Exception as exc:  # the storage itself may be what failed
            log.warning("could not mark trial #%d failed: %s", trial.number, exc)


def recover(
    study: Any,
    ownerless: OwnerlessWatch,
    trials: Sequence[Any] | None = None,
    stale_gate: StaleGate | None = None,
) -> bool:
    """Fail and re-queue trials whose worker died: on this host (pid gone) or anywhere
    (heartbeat stale, or no owner, for grace_period); whether it failed any (the study changed).

    `trials`: the study's trials as read a moment ago (the trial loop's read after its last tell),
    None: read once here; read again after a step failed some (the next step sees them FAIL). A
    snapshot is enough to find the candidates: a dead worker's trial stays RUNNING until someone
    fails it, and failing one finished meanwhile does nothing (`fail_and_requeue`). The storage's
    stale check only when `stale_gate` says it is due (None: always)."""
    trials = _read(study, trials)
    heartbeats = heartbeat_enabled(storage_of(study))
    steps: list[tuple[Callable[[Sequence[Any]], list[int]], str]] = [
        (lambda t: recover_interrupted(study, t), "a killed sweep on this host")
    ]
    if stale_gate is None or stale_gate.due():
        steps.append((lambda t: fail_stale(study, t), "a worker whose heartbeat stopped"))
    if heartbeats:
        steps.append(
            (lambda t: ownerless.fail_dead(study, t), "a worker that died right after asking")
        )
    changed = False
    for step, cause in steps:
        numbers = step(trials)
        if numbers:
            changed = True
            trials = study.get_trials(deepcopy=False)
            log.warning(
                "trials %s were interrupted by %s: marked FAIL, their params enqueued again",
                numbers,
                cause,
            )
    return changed


def frozen_of(trials: Sequence[Any], number: int) -> Any | None:
    """Trial `number` of a study's trials (as `get_trials` lists them: by number, from 0)."""
    if 0 <= number < len(trials) and trials[number].number == number:
        return trials[number]
    return next((t for t in trials if t.number == number), None)


def _read(study: Any, trials: Sequence[Any] | None) -> Sequence[Any]:
    """The snapshot the caller passed, or the study's trials read now."""
    return study.get_trials(deepcopy=False) if trials is None else trials


def exit_interrupted(study: Any, what: str) -> None:
    """A sweep stopped by Ctrl-C, SIGTERM or SIGHUP: its running trials marked interrupted at
    once (params re-queued, as a resume would), one line on stderr, the signal's exit status."""
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
