"""Every private Optuna / Hydra / submitit internal gpuopt uses, in one place.

A minor release may move any of these: each wrapper says why no public API does the job, and
tests/test_compat.py exercises every one against the installed libraries, so an upgrade that moves
one fails that test by name instead of a sweep. Imports are lazy: Hydra's plugin discovery imports
this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# ---- Optuna: study and trial handles -------------------------------------------------------------


def storage_of(study: Any) -> Any:
    """The study's storage (no public accessor): for what Study does not offer (a RUNNING trial's
    system attrs, failing a dead worker's trial with a reason, study system attrs, heartbeats)."""
    return study._storage


def trial_id(trial: Any) -> int:
    """The storage's id of a Trial or FrozenTrial (not its number; not public)."""
    return trial._trial_id


def unwrap_storage(storage: Any) -> Any:
    """The backend behind Optuna's `_CachedStorage` wrapper of every RDBStorage a study opens."""
    return getattr(storage, "_backend", storage)


# ---- Optuna: heartbeats ---------------------------------------------------------------------------
# Optuna beats only inside Study.optimize, and its public `fail_stale_trials` cannot record why nor
# re-queue params once across workers: gpuopt's own loop runs the thread and reads stale trials.


def heartbeat_base() -> type:
    """Optuna's heartbeat interface (`_heartbeat.BaseHeartbeat`), not exported publicly."""
    from optuna.storages._heartbeat import BaseHeartbeat

    return BaseHeartbeat


def heartbeat_enabled(storage: Any) -> bool:
    """Whether the storage beats (a BaseHeartbeat with an interval): Optuna's own rule, private."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return storage is not None and is_heartbeat_enabled(storage)


def heartbeat_thread(trial: Any, storage: Any) -> Any:
    """Optuna's heartbeat thread for one trial that beat when it was asked (private): it beats
    every interval from `start()` on, not at once (a second beat right after the first costs a
    commit per trial, ~5 ms on SQLite). No heartbeat on the storage: Optuna's no-op thread."""
    from optuna.storages._heartbeat import get_heartbeat_thread, is_heartbeat_enabled

    if is_heartbeat_enabled(storage):
        return _beat_after_interval_thread()(trial_id(trial), storage)
    return get_heartbeat_thread(trial_id(trial), storage)


@functools.cache
def _beat_after_interval_thread() -> type:
    from optuna.storages._heartbeat import HeartbeatThread

    def record(trial_id: int, heartbeat: Any, stop_event: Any) -> None:
        interval = heartbeat.get_heartbeat_interval()
        while not stop_event.wait(timeout=interval):
            heartbeat.record_heartbeat(trial_id)

    return type(
        "BeatAfterInterval", (HeartbeatThread,), {"_record_heartbeat": staticmethod(record)}
    )


def stale_trial_ids(storage: Any, study_id: int) -> list[int]:
    """The RUNNING trials whose heartbeat is older than the grace period (a private method)."""
    return list(storage._get_stale_trial_ids(study_id))


class StaleTrialsByPublicName:
    """Mixin: Optuna calls the private `_get_stale_trial_ids`; a storage implements it as
    `stale_trial_ids`."""

    def stale_trial_ids(self, study_id: int) -> list[int]:
        raise NotImplementedError

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        return self.stale_trial_ids(study_id)


# ---- Optuna: constraints -------------------------------------------------------------------------


def constraints_key() -> str:
    """The trial system attr of a trial's constraint values (`_base._CONSTRAINTS_KEY`): what the
    samplers and optuna-dashboard (0.21) read; Optuna 5's public `Trial.set_constraint` writes
    per-key attrs the dashboard does not read."""
    from optuna.samplers._base import _CONSTRAINTS_KEY

    return str(_CONSTRAINTS_KEY)


# ---- Optuna: RDB storage, many user attrs in one transaction --------------------------------------


def set_user_attrs_in_one_transaction(storage: Any, trial_id_: int, attrs: dict[str, Any]) -> bool:
    """Write all attrs in one RDB transaction (the public call commits per key: ~30 commits per
    trial, a few ms each on SQLite); False when the storage is not an RDBStorage."""
    return _in_one_transaction(storage, trial_id_, attrs, system=False)


def set_system_attr_and_beat(storage: Any, trial_id_: int, key: str, value: Any) -> bool:
    """A just-asked trial's system attr and its first heartbeat in one RDB transaction (one commit
    each otherwise: ~5 ms apiece on SQLite); False when the storage is not an RDBStorage with
    heartbeats."""
    return _in_one_transaction(storage, trial_id_, {key: value}, system=True)


def _in_one_transaction(storage: Any, trial_id_: int, attrs: dict[str, Any], system: bool) -> bool:
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    backend = unwrap_storage(storage)
    if not isinstance(backend, RDBStorage) or (system and not backend.get_heartbeat_interval()):
        return False
    model = models.TrialSystemAttributeModel if system else models.TrialUserAttributeModel
    with _create_scoped_session(backend.scoped_session, True) as session:
        for key, value in attrs.items():
            backend._set_trial_attr_without_commit(session, model, trial_id_, key, value)
        if system and models.TrialHeartbeatModel.where_trial_id(trial_id_, session) is None:
            session.add(models.TrialHeartbeatModel(trial_id=trial_id_))
    return True


# ---- hydra-optuna-sweeper ---------------------------------------------------------------------------


def stock_sweeper_impl() -> type:
    """hydra-optuna-sweeper's `OptunaSweeperImpl` (private `_impl`), which gpuopt's loop subclasses."""
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

    return OptunaSweeperImpl


def create_params_from_overrides(overrides: list[str]) -> tuple[dict, dict, list]:
    """Hydra sweep syntax -> Optuna distributions, fixed params and fixed overrides (the stock
    sweeper's parser, private `_impl`)."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides as create

    return create(overrides)


def grid_choices(distribution: Any) -> Any:
    """A discrete distribution's grid values, as the stock sweeper gives them to GridSampler."""
    return stock_sweeper_impl()._to_grid_sampler_choices(distribution)


# ---- hydra-submitit-launcher / submitit -----------------------------------------------------------


def submitit_executor_kind(launcher: Any) -> str | None:
    """ "local" or "slurm" for a hydra-submitit-launcher launcher (private `_EXECUTOR`), else None."""
    return getattr(launcher, "_EXECUTOR", None)


def local_executor_class(start: Callable[[Any, str, dict[str, Any]], Any]) -> type:
    """submitit's LocalExecutor, starting each job's controller with `start(folder, command,
    parameters)` (a Popen): submitit has no hook for how it starts (gpuopt needs a new session
    and its own controller)."""
    from submitit.local.local import LocalExecutor, LocalJob

    class Executor(LocalExecutor):  # type: ignore[misc,valid-type]
        def _submit_command(self, command: str) -> Any:
            process = start(self.folder, command, self.parameters)
            ntasks = self.parameters.get("tasks_per_node", 1)
            return LocalJob(
                folder=self.folder, job_id=str(process.pid), process=process, tasks=range(ntasks)
            )

    return Executor


def job_process(job: Any) -> Any:
    """The Popen of a submitit LocalJob (private; None once unpickled)."""
    return job._process


def local_controller_class() -> type:
    """submitit's local job controller (undocumented), subclassed to write the tasks' exit codes."""
    from submitit.local.local import Controller

    return Controller


# ---- Hydra: the command line of a @hydra.main app -------------------------------------------------


def hydra_args_parser() -> Any:
    """Hydra's argparse parser of a `@hydra.main` app (private): a bad argument in one line
    instead of argparse's usage block."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def report_as_hydra(failure: BaseException) -> None:
    """Report an exception as `@hydra.main` does and exit 1 (private `run_and_report`): for the
    errors gpuopt's CLI caught that are not bad input."""
    from hydra._internal.utils import run_and_report

    def reraise() -> None:
        raise failure

    run_and_report(reraise)


def launcher_chosen(config_loader: Any, config: Any) -> bool:
    """Whether the app or its command line chose `hydra/launcher` rather than leaving Hydra's
    default: the composed `hydra.runtime.choices` says `basic` either way, only the defaults
    list's private `override_choices` tells."""
    from hydra.types import RunMode

    overrides = [*config.hydra.overrides.hydra, *config.hydra.overrides.task]
    defaults = config_loader.compute_defaults_list(
        config.hydra.job.config_name, [str(o) for o in overrides], RunMode.MULTIRUN
    )
    return "hydra/launcher" in defaults.overrides.override_choices


# ---- Hydra 1.4: what gpuopt's pin must not change in the user's own app ---------------------------
# Two of 1.4's changes would reach an app written for Hydra 1.3: `_partial_` factories that refuse
# pickling (Lightning's `save_hyperparameters` then drops them, and lightning-hydra-template's
# `configure_optimizers` fails), and a 7-line warning per `_target_` instantiated without an
# execution whitelist. gpuopt.hydra_interop applies both adapters in every Hydra app.

HYDRA_STATE_NOT_PICKLED = ("_hydra_execution_policy", "_hydra_call_context")  # this call's runtime


def picklable_hydra_partials() -> None:
    """Hydra 1.4's `_partial_: true` object (`_DeferredTarget`) pickles as a functools.partial,
    as on Hydra 1.3: with the execution whitelist it was made under, without the live call
    context. Hydra 1.4 refuses ("cannot be pickled before invocation"). Idempotent."""
    from hydra._internal.execution_policy import _DeferredTarget

    if getattr(_DeferredTarget, "_gpuopt_picklable", False):
        return

    def reduce(self: Any, protocol: Any = None) -> tuple[Any, ...]:
        cls, args, (func, fargs, keywords, attrs) = functools.partial.__reduce__(self)
        kept = {k: v for k, v in (attrs or {}).items() if k not in HYDRA_STATE_NOT_PICKLED}
        return cls, args, (func, fargs, keywords, kept or None)

    _DeferredTarget.__reduce__ = reduce
    _DeferredTarget.__reduce_ex__ = reduce
    _DeferredTarget._gpuopt_picklable = True


WHITELIST_NOTE = (
    "Hydra 1.4 (gpuopt's Hydra) instantiates this app's _target_s (first: {target}) without an "
    "execution whitelist, as Hydra 1.3 did, and will refuse that in 1.5: pass one with "
    "@hydra.main(..., execution_whitelist=[...]) or instantiate(cfg, _execution_whitelist_=[...]) "
    "(https://hydra.cc/docs/advanced/execution_whitelist/). Said once per process by gpuopt "
    "instead of Hydra's 7 lines per target."
)


def whitelist_warning_once() -> None:
    """Hydra 1.4's legacy-whitelist deprecation warning (7 lines per `_target_`) said once per
    process; HYDRA_DEPRECATION_WARNINGS_AS_ERRORS keeps Hydra's own (it raises). Idempotent."""
    import os
    import warnings

    from hydra._internal.instantiate import _instantiate2

    hydras = _instantiate2._warn_legacy_execution_whitelist
    if getattr(hydras, "_gpuopt_once", False):
        return
    said: list[str] = []

    def once(target: str) -> None:
        if os.environ.get("HYDRA_DEPRECATION_WARNINGS_AS_ERRORS"):
            hydras(target)
        elif not said:
            said.append(target)
            warnings.warn(WHITELIST_NOTE.format(target=target), UserWarning, stacklevel=3)

    once._gpuopt_once = True  # type: ignore[attr-defined]
    _instantiate2._warn_legacy_execution_whitelist = once
