"""Resuming a study: which trials count towards n_trials, and what a killed sweep left behind.

Each trial records its owner (host, pid and process start time of the sweeping process) in its
system attrs. On start, a RUNNING trial whose owner is on this host and no longer alive was
interrupted: it is marked FAIL with the reason in its user attrs and its params are enqueued again,
so the configuration is re-measured rather than silently lost. Owners on other hosts are left alone
(detecting those needs Optuna's heartbeat, for multi-host sweeps).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from gpuopt.result import ATTR_BASELINE, ATTR_REASON, ATTR_STATUS

OWNER_ATTR = "gpuopt:owner"  # system attr: {"host", "pid", "start"}
INTERRUPTED_ATTR = "interrupted"  # user attr: True on a trial whose sweep died under it
RERUN_OF_ATTR = "rerun_of"  # user attr on the re-enqueued trial: number of the interrupted one


def _start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    try:
        return int(fields[19])  # field 22 overall: starttime
    except (IndexError, ValueError):
        return None


def this_owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid)}


def owner_alive(owner: dict[str, Any] | None, host: str | None = None) -> bool | None:
    """True/False for an owner on this host; None when it cannot be told (another host, no owner)."""
    if not isinstance(owner, dict) or owner.get("host") != (host or socket.gethostname()):
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    recorded = owner.get("start")
    if recorded is not None:
        current = _start_ticks(pid)
        if current is not None and current != recorded:
            return False  # the pid was reused by another process
    return True


def interrupted_trials(trials: Sequence[Any]) -> list[Any]:
    """RUNNING trials whose sweeping process on this host is gone."""
    from optuna.trial import TrialState

    return [
        t
        for t in trials
        if t.state == TrialState.RUNNING and owner_alive(t.system_attrs.get(OWNER_ATTR)) is False
    ]


def recover_interrupted(study: Any) -> list[int]:
    """Mark interrupted trials FAIL (reason recorded) and enqueue their params again."""
    from optuna.trial import TrialState, create_trial

    recovered = []
    for trial in interrupted_trials(study.get_trials(deepcopy=False)):
        owner = trial.system_attrs.get(OWNER_ATTR) or {}
        reason = (
            f"interrupted: the sweeping process {owner.get('host')}:{owner.get('pid')} ended while "
            "this trial ran; its params were enqueued again"
        )
        storage, tid = study._storage, trial._trial_id
        storage.set_trial_user_attr(tid, ATTR_STATUS, "error")
        storage.set_trial_user_attr(tid, ATTR_REASON, reason)
        storage.set_trial_user_attr(tid, INTERRUPTED_ATTR, True)
        study.tell(trial.number, state=TrialState.FAIL)
        attrs: dict[str, Any] = {RERUN_OF_ATTR: trial.number}
        if trial.user_attrs.get(ATTR_BASELINE):
            attrs[ATTR_BASELINE] = True
        system_attrs: dict[str, Any] = {"fixed_params": dict(trial.params)}
        for key in ("grid_id", "search_space"):  # GridSampler: the same grid point, re-run
            if key in trial.system_attrs:
                system_attrs[key] = trial.system_attrs[key]
        study.add_trial(
            create_trial(state=TrialState.WAITING, system_attrs=system_attrs, user_attrs=attrs)
        )
        recovered.append(trial.number)
    return recovered


def counted(trial: Any) -> bool:
    """Whether a trial counts towards n_trials: finished, and not an interrupted one (re-run)."""
    from optuna.trial import TrialState

    if trial.state == TrialState.RUNNING:
        return owner_alive(trial.system_attrs.get(OWNER_ATTR)) is not False  # in flight elsewhere
    if trial.state == TrialState.WAITING:
        return False
    return not trial.user_attrs.get(INTERRUPTED_ATTR, False)


def trials_to_go(trials: Sequence[Any], n_trials: int) -> int:
    return max(0, n_trials - sum(1 for t in trials if counted(t)))


def has_baseline(trials: Sequence[Any]) -> bool:
    """A baseline trial exists (finished, running, or waiting to be re-run)."""
    return any(
        t.user_attrs.get(ATTR_BASELINE) and not t.user_attrs.get(INTERRUPTED_ATTR) for t in trials
    )
