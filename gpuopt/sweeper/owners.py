"""Which worker owns which trial, and which trials count towards n_trials: the study's pure reads
that progress, the baseline and the trial loop ask (resume.py writes what these find).

A freshly asked trial runs only if fewer than n_trials counted-or-waiting trials have a lower
number (`is_surplus`); storage-assigned numbers mean two racing workers never both see the other
ahead."""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from gpuopt.core._compat import storage_of
from gpuopt.core.lifeline import process_alive, start_ticks
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_INTERRUPTED,
    ATTR_OWNER,
    ATTR_VOID,
    STUDY_CONFIRM_CLAIM,
)


def host_name() -> str:
    """This worker's host as recorded on its trials. GPUOPT_HOSTNAME overrides it where hosts
    share a name (containers): pid checks are only made for trials of the same host name."""
    return os.environ.get("GPUOPT_HOSTNAME") or socket.gethostname()


def worker_name(owner: dict[str, Any] | None) -> str:
    owner = owner or {}
    return f"{owner.get('host')}:{owner.get('pid')}"


def this_owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": host_name(), "pid": pid, "start": start_ticks(pid)}


def owner_alive(owner: dict[str, Any] | None) -> bool | None:
    """True/False for an owner on this host (a zombie or a reused pid is dead); None when it
    cannot be told (another host, no owner)."""
    if not isinstance(owner, dict) or owner.get("host") != host_name():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return None
    return process_alive(pid, owner.get("start"))


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
    WAITING trials count as ahead: popped by another worker, or re-runs that go first."""
    return held(t for t in trials if t.number < number) >= n_trials


def held(trials: Iterable[Any]) -> int:
    """The trials that hold a place among n_trials: counted ones and WAITING ones (queued)."""
    from optuna.trial import TrialState

    return sum(1 for t in trials if counted(t) or t.state == TrialState.WAITING)


def duplicate_baseline(number: int, trials: Sequence[Any]) -> bool:
    """Whether trial `number` is a baseline enqueued twice (two workers started at once)."""
    return has_baseline(t for t in trials if t.number < number)


def running_elsewhere(trials: Sequence[Any]) -> list[Any]:
    """RUNNING trials another live worker is measuring (other hosts: alive until their
    heartbeat goes stale). While any remain, this worker is not the study's last."""
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


def has_baseline(trials: Iterable[Any]) -> bool:
    """A baseline trial exists (finished, running, or waiting to be re-run)."""
    return any(
        t.user_attrs.get(ATTR_BASELINE)
        and not t.user_attrs.get(ATTR_INTERRUPTED)
        and not t.user_attrs.get(ATTR_VOID)
        for t in trials
    )


_STUDY_IDS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def study_id(study: Any) -> int:
    """The storage's id of a study, looked up once per Study object (the heartbeat check asked
    for it between every two batches: one storage query per trial)."""
    sid = _STUDY_IDS.get(study)
    if sid is None:
        sid = _STUDY_IDS[study] = storage_of(study).get_study_id_from_name(study.study_name)
    return sid


def frozen_of(trials: Sequence[Any], number: int) -> Any | None:
    """Trial `number` of a study's trials (as `get_trials` lists them: by number, from 0)."""
    if 0 <= number < len(trials) and trials[number].number == number:
        return trials[number]
    return next((t for t in trials if t.number == number), None)


def live_claim(study: Any, after_trials: int) -> dict[str, Any] | None:
    """The confirmation's claim for a study of `after_trials` trials, unless its owner is gone."""
    claim = storage_of(study).get_study_system_attrs(study_id(study)).get(STUDY_CONFIRM_CLAIM)
    if isinstance(claim, dict) and claim.get("after_trials") == after_trials:
        return claim if owner_alive(claim.get("owner")) is not False else None
    return None
