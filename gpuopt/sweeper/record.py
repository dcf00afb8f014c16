"""How one finished trial is written to the study: the public API.

The sweep loop and the tests that build studies both go through these, so a study built by hand
reads exactly like one a sweep wrote (which trial is best: schema.pick_best):
- `outcome_of(ret, names, directions)`: a launcher's JobReturn (or exception) -> TrialOutcome;
- `record_trial(study, trial, overrides, ret, outcome)`: user attrs, constraints, tell.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from optuna.trial import Trial, TrialState

from gpuopt.core import measured_job
from gpuopt.core._compat import constraints_key, storage_of, trial_id
from gpuopt.core.secrets import mask_secrets
from gpuopt.study.attrs import set_user_attrs
from gpuopt.study.keys import (
    ATTR_LOGS,
    ATTR_OVERRIDES,
    ATTR_RUN_DIR,
    ATTR_STATUS,
    ATTR_TRACEBACK,
    ATTR_VISIBLE_DEVICES,
)
from gpuopt.sweeper.objectives import TrialOutcome, error_outcome, outcome_from_return

TRACEBACK_CHARS = 4000


def _error(exc: BaseException, prefix: str = "") -> TrialOutcome:
    """An error outcome for an exception; a gpuopt launcher's TrialProcessError is its own reason."""
    log_tail = getattr(exc, "log_tail", None)
    if (
        log_tail is not None
    ):  # gpuopt.sweeper.launchers.results.TrialProcessError (not imported: light)
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
    something else: a launcher other than gpuopt's (hydra/launcher=basic) reads it here, as
    gpuopt's trial task does in the trial's process (gpuopt.core.measured_job)."""
    folder = run_dir(ret)
    measured = measured_job.read(Path(folder)) if folder else None
    if measured is None or measured_job.is_gpuopts_result(value):
        return value
    return measured_job.with_app_return(measured, value)


def run_dir(ret: Any) -> str | None:
    cfg = getattr(ret, "hydra_cfg", None)
    try:
        return str(cfg.hydra.runtime.output_dir) if cfg is not None else None
    except Exception:
        return None


def record_trial(
    study: optuna.Study,
    trial: Trial,
    overrides: list[str],
    ret: Any,
    outcome: TrialOutcome,
) -> None:
    """Write the trial's user attrs in one transaction, its constraints, then tell the study.

    `error` -> FAIL; ok/oom/diverged -> COMPLETE with values and constraints (oom/diverged are
    infeasible: constraint 1.0). Strings are passed through `mask_secrets` first: a reason or
    traceback may quote a storage URL.
    """
    attrs = {k: mask_secrets(v) if isinstance(v, str) else v for k, v in outcome.user_attrs.items()}
    attrs[ATTR_OVERRIDES] = [mask_secrets(str(o)) for o in overrides]
    attrs[ATTR_RUN_DIR] = run_dir(ret)
    diagnostics = getattr(ret, "gpuopt_diagnostics", None)  # gpuopt's launchers: logs, traceback
    if diagnostics is not None:
        attrs[ATTR_LOGS] = diagnostics.logs
        attrs[ATTR_RUN_DIR] = attrs[ATTR_RUN_DIR] or diagnostics.run_dir
        if outcome.failed and diagnostics.traceback:
            attrs[ATTR_TRACEBACK] = mask_secrets(diagnostics.traceback)
    devices = getattr(ret, "gpuopt_visible_devices", None)
    if devices is not None:
        attrs[ATTR_VISIBLE_DEVICES] = devices
    # ATTR_BASELINE is already on the baseline trial (set when it was enqueued); absent = False.
    attrs.setdefault(ATTR_STATUS, outcome.status)
    set_user_attrs(storage_of(study), trial_id(trial), attrs)
    if not outcome.failed and outcome.constraints:
        # The list under Optuna's `constraints` key, in CONSTRAINT_KEYS order (oom, diverged, numerics): what
        # Optuna's constraints_func machinery writes, read by its samplers and optuna-dashboard.
        storage_of(study).set_trial_system_attr(
            trial_id(trial), constraints_key(), list(outcome.constraints.values())
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
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
