"""The one module that writes the study: every Optuna write of gpuopt goes through here.

The study is what users (the report, the `optuna` CLI, optuna-dashboard) read, so what is written,
and that no secret is (`mask_secrets`), is checked in one place (tests/test_architecture.py holds
the rule); a study built by hand in tests reads exactly like one a sweep wrote."""

from __future__ import annotations

import contextlib
import json
import logging
import traceback
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from optuna.trial import Trial, TrialState

from gpuopt.core import measured_job
from gpuopt.core._compat import (
    constraints_key,
    set_user_attrs_in_one_transaction,
    storage_of,
    trial_id,
)
from gpuopt.core.secrets import mask_secrets
from gpuopt.study.keys import (
    ATTR_LOGS,
    ATTR_OVERRIDES,
    ATTR_REASON,
    ATTR_RUN_DIR,
    ATTR_STATUS,
    ATTR_TRACEBACK,
    ATTR_VISIBLE_DEVICES,
    STUDY_CONFIRMATION,
)
from gpuopt.study.records import Confirmation
from gpuopt.sweeper.objectives import TrialOutcome, error_outcome, outcome_from_return

TRACEBACK_CHARS = 4000
REASON_CHARS = 2000

log = logging.getLogger(__name__)


def _error(exc: BaseException, prefix: str = "") -> TrialOutcome:
    """An error outcome for an exception; a gpuopt launcher's TrialProcessError is its own reason."""
    log_tail = getattr(exc, "log_tail", None)  # launchers.results.TrialProcessError (not imported)
    if log_tail is not None:
        outcome = error_outcome(str(exc))
        outcome.user_attrs[ATTR_TRACEBACK] = log_tail[-TRACEBACK_CHARS:]
        return outcome
    outcome = error_outcome(f"{prefix}{type(exc).__name__}: {exc}")
    outcome.user_attrs[ATTR_TRACEBACK] = "".join(traceback.format_exception(exc))[-TRACEBACK_CHARS:]
    return outcome


def outcome_of(
    ret: JobReturn | BaseException, names: list[str], directions: list[str]
) -> TrialOutcome:
    """What a launcher returned for one job, as values/constraints/user attrs (never raises)."""
    if isinstance(ret, BaseException):
        return _error(ret, prefix="launcher: ")
    if ret.status is JobStatus.COMPLETED:
        return outcome_from_return(_measured_or(ret, ret.return_value), names, directions)
    try:
        value = ret.return_value  # raises the task's exception
    except BaseException as exc:
        return _error(exc)
    return outcome_from_return(value, names, directions)


def _measured_or(ret: Any, value: Any) -> Any:
    """A job's measuring callback's result from its run directory, where the task returned
    something else (a launcher other than gpuopt's reads it here)."""
    folder = run_dir(ret)
    measured = measured_job.read(Path(folder)) if folder else None
    if measured is None or measured_job.is_gpuopts_result(value):
        return value
    return measured_job.with_app_return(measured, value)


def run_dir(ret: Any) -> str | None:
    """The job's run dir: Hydra's, else the one gpuopt's launchers knew (a trial that ended
    without reporting its own)."""
    with contextlib.suppress(Exception):
        return str(ret.hydra_cfg.hydra.runtime.output_dir)
    return getattr(getattr(ret, "gpuopt_diagnostics", None), "run_dir", None)


def record_trial(
    study: optuna.Study,
    trial: Trial,
    overrides: list[str],
    ret: Any,
    outcome: TrialOutcome,
) -> None:
    """Write the trial's user attrs in one transaction, its constraints, then tell the study.
    `error` -> FAIL; oom/diverged -> COMPLETE, infeasible (constraint 1.0). Strings are masked: a
    reason or traceback may quote a storage URL."""
    attrs = dict(outcome.user_attrs)
    attrs[ATTR_OVERRIDES] = [mask_secrets(str(o)) for o in overrides]
    attrs[ATTR_RUN_DIR] = run_dir(ret)
    diagnostics = getattr(ret, "gpuopt_diagnostics", None)  # gpuopt's launchers: logs, traceback
    if diagnostics is not None:
        attrs[ATTR_LOGS] = diagnostics.logs
        if outcome.failed and diagnostics.traceback:
            attrs[ATTR_TRACEBACK] = mask_secrets(diagnostics.traceback)
    devices = getattr(ret, "gpuopt_visible_devices", None)
    if devices is not None:
        attrs[ATTR_VISIBLE_DEVICES] = devices
    # ATTR_BASELINE is already on the baseline trial (set when it was enqueued); absent = False.
    attrs.setdefault(ATTR_STATUS, outcome.status)
    trial_attrs(study, trial, attrs)
    if not outcome.failed and outcome.constraints:
        # The list under Optuna's `constraints` key, in CONSTRAINT_KEYS order (oom, diverged, numerics): what
        # Optuna's constraints_func machinery writes, read by its samplers and optuna-dashboard.
        storage_of(study).set_trial_system_attr(
            trial_id(trial), constraints_key(), list(outcome.constraints.values())
        )
    with _quiet():
        try:
            if outcome.failed:
                study.tell(trial, state=TrialState.FAIL)
            else:
                study.tell(trial, values=outcome.values, state=TrialState.COMPLETE)
        except RuntimeError as exc:
            # GridSampler calls Study.stop once the grid is done, which raises outside optimize();
            # the trial's state is stored before that (optuna's _tell stores it in `finally`).
            if "Study.stop" not in str(exc):
                raise


# ---- the other ends of a trial ------------------------------------------------------------------


def prune_trial(
    study: optuna.Study, trial: Trial, attrs: Mapping[str, Any], reading: float | None = None
) -> None:
    """Told PRUNED with its attrs (the race's screen: what it read, why it went no further);
    `reading` is Optuna's intermediate value at step 0 (one objective only)."""
    trial_attrs(study, trial, attrs)
    if reading is not None and len(study.directions) == 1:
        trial.report(float(reading), step=0)
    with _quiet():
        study.tell(trial, state=TrialState.PRUNED)


def fail_trial(study: Any, trial: Any, attrs: Mapping[str, Any]) -> bool:
    """FAIL a trial through the storage (it may be another worker's: no Trial object), with its
    attrs (a reason masked before it is cut, so no part of a secret is left); False when it was
    already finished (another worker got there first)."""
    from optuna.exceptions import UpdateFinishedTrialError

    storage, tid, masked = storage_of(study), trial_id(trial), _masked(attrs)
    if isinstance(masked.get(ATTR_REASON), str):
        masked[ATTR_REASON] = masked[ATTR_REASON][:REASON_CHARS]
    try:
        for key, value in masked.items():
            storage.set_trial_user_attr(tid, key, value)
        return bool(storage.set_trial_state_values(tid, state=TrialState.FAIL))
    except UpdateFinishedTrialError:
        return False


# ---- records around trials ----------------------------------------------------------------------


def trial_attrs(study: Any, trial: Any, attrs: Mapping[str, Any]) -> None:
    """A trial's user attrs, strings masked, in one storage transaction where the storage allows:
    Optuna's `set_trial_user_attr` commits once per key (a few ms each on SQLite, ~30 attrs a trial);
    other storages get the public call, key by key."""
    storage, tid, masked = storage_of(study), trial_id(trial), _masked(attrs)
    try:
        if set_user_attrs_in_one_transaction(storage, tid, masked):
            return
    except (ImportError, AttributeError, TypeError) as exc:  # internals changed: the public way
        log.debug("bulk user attrs unavailable (%s); writing them one by one", exc)
    for key, value in masked.items():
        storage.set_trial_user_attr(tid, key, value)


def study_attrs(study: Any, attrs: Mapping[str, Any]) -> None:
    """Study user attrs, JSON-normalized as Optuna's storages keep them."""
    for key, value in attrs.items():
        study.set_user_attr(key, json.loads(json.dumps(value, default=str)))


def store_confirmation(study: Any, record: Confirmation) -> Confirmation:
    """The confirmation's record (sweeper/confirm/rounds.py assembles it) as the study user
    attr; the record as readers will see it."""
    study_attrs(study, {STUDY_CONFIRMATION: record.to_attr()})
    confirmation = Confirmation.from_attr(study.user_attrs[STUDY_CONFIRMATION])
    assert confirmation is not None, "a confirmation record has a list of comparisons"
    return confirmation


def metric_names(study: optuna.Study, names: list[str]) -> None:
    """The study's own metric names (optuna-dashboard's labels): an experimental API, never
    worth failing a sweep over."""
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        study.set_metric_names(names)


def add_waiting_trial(
    study: Any, system_attrs: Mapping[str, Any], user_attrs: Mapping[str, Any]
) -> None:
    """A WAITING trial with gpuopt's attrs (what `study.enqueue_trial` does, plus the grid's or
    a re-run's system attrs)."""
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING, system_attrs=dict(system_attrs), user_attrs=dict(user_attrs)
        )
    )


def enqueue(
    study: Any, params: Mapping[str, Any], user_attrs: Mapping[str, Any], skip_if_exists: bool
) -> None:
    study.enqueue_trial(dict(params), user_attrs=dict(user_attrs), skip_if_exists=skip_if_exists)


def trial_system_attr(storage: Any, tid: int, key: str, value: Any) -> None:
    storage.set_trial_system_attr(tid, key, value)


def study_system_attr(storage: Any, sid: int, key: str, value: Any) -> None:
    storage.set_study_system_attr(sid, key, value)


def _masked(attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: mask_secrets(v) if isinstance(v, str) else v for k, v in attrs.items()}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Optuna's ExperimentalWarning (a PRUNED tell, a multi-objective tell) is not the user's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield
