"""Every private Optuna / Hydra / submitit internal gpuopt uses, in one place.

Optuna is pinned `>=5,<6` and Hydra is a release candidate: a minor release may move any of these.
Each wrapper says why no public API does the job; tests/test_compat.py exercises every one of them
against the installed libraries, so an upgrade that moves one fails that test, by name, instead of
a sweep. Nothing else in gpuopt/ may touch a private name of these libraries.

Imports are lazy (inside the functions) where the library is heavy or optional, so that importing
this module costs nothing in Hydra's plugin discovery.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

# ---- Optuna: study and trial handles -------------------------------------------------------------


def storage_of(study: Any) -> Any:
    """The study's storage object. Study exposes no public accessor, and gpuopt needs the storage
    for what Study does not offer: writing a RUNNING trial's system attrs (its owner), failing a
    dead worker's trial with a reason, study system attrs (the confirmation claim), heartbeats."""
    return study._storage


def trial_id(trial: Any) -> int:
    """The storage's id of a Trial or FrozenTrial (not its number). Every storage method takes it,
    and neither class exposes it publicly."""
    return trial._trial_id


def unwrap_storage(storage: Any) -> Any:
    """The backend behind Optuna's `_CachedStorage` (which wraps every RDBStorage that
    `optuna.create_study`/`load_study` open): its class and settings (grace_period) are the
    backend's; the wrapper has no public way to reach them."""
    return getattr(storage, "_backend", storage)


# ---- Optuna: heartbeats ---------------------------------------------------------------------------
# Optuna runs heartbeats only inside Study.optimize; gpuopt runs its own loop (ask, launch in other
# processes, tell), so it starts the heartbeat thread and reads stale trials itself. The public
# `optuna.storages.fail_stale_trials` fails stale trials but cannot record why, nor re-queue their
# params once across several workers.


def heartbeat_base() -> type:
    """Optuna's heartbeat interface (`optuna.storages._heartbeat.BaseHeartbeat`): the class
    `is_heartbeat_enabled` checks for. Not exported publicly."""
    from optuna.storages._heartbeat import BaseHeartbeat

    return BaseHeartbeat


def heartbeat_enabled(storage: Any) -> bool:
    """Whether the storage beats (a BaseHeartbeat with an interval): Optuna's own rule, private."""
    from optuna.storages._heartbeat import is_heartbeat_enabled

    return storage is not None and is_heartbeat_enabled(storage)


def heartbeat_thread(trial: Any, storage: Any) -> Any:
    """Optuna's heartbeat thread for one trial (what Study.optimize uses; private), for a trial
    that beat when it was asked: `start()` beats every interval from then on, not at once (a
    second beat a millisecond after the first costs a storage commit per trial, ~5 ms on
    SQLite); `join()` stops it. No heartbeat on the storage: Optuna's thread that does nothing."""
    from optuna.storages._heartbeat import get_heartbeat_thread, is_heartbeat_enabled

    if is_heartbeat_enabled(storage):
        return _beat_after_interval_thread()(trial_id(trial), storage)
    return get_heartbeat_thread(trial_id(trial), storage)


@functools.cache
def _beat_after_interval_thread() -> type:
    """HeartbeatThread whose loop waits one interval before each beat."""
    from optuna.storages._heartbeat import HeartbeatThread

    def record(trial_id: int, heartbeat: Any, stop_event: Any) -> None:
        interval = heartbeat.get_heartbeat_interval()
        while not stop_event.wait(timeout=interval):
            heartbeat.record_heartbeat(trial_id)

    return type(
        "BeatAfterInterval", (HeartbeatThread,), {"_record_heartbeat": staticmethod(record)}
    )


def stale_trial_ids(storage: Any, study_id: int) -> list[int]:
    """The RUNNING trials whose heartbeat is older than the grace period: the storage's own check
    (what `fail_stale_trials` uses), a private method of BaseHeartbeat."""
    return list(storage._get_stale_trial_ids(study_id))


class StaleTrialsByPublicName:
    """Mixin for a storage that implements Optuna's heartbeat interface: Optuna calls the private
    `_get_stale_trial_ids`; the storage implements it under the public name `stale_trial_ids`."""

    def stale_trial_ids(self, study_id: int) -> list[int]:
        raise NotImplementedError

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        return self.stale_trial_ids(study_id)


# ---- Optuna: constraints -------------------------------------------------------------------------


def constraints_key() -> str:
    """The trial system attr holding a trial's constraint values as a list
    (`optuna.samplers._base._CONSTRAINTS_KEY`): what Optuna's samplers write for a
    `constraints_func` and what optuna-dashboard (0.21) reads to tell feasible trials; Optuna 5's
    public `Trial.set_constraint` writes per-key attrs ("constraints:<name>") that the dashboard
    does not read. Not exported publicly."""
    from optuna.samplers._base import _CONSTRAINTS_KEY

    return str(_CONSTRAINTS_KEY)


# ---- Optuna: RDB storage, many user attrs in one transaction --------------------------------------


def set_user_attrs_in_one_transaction(storage: Any, trial_id_: int, attrs: dict[str, Any]) -> bool:
    """Write all attrs in one RDB transaction; False when the storage is not an RDBStorage.

    Optuna's public `set_trial_user_attr` commits once per key: ~30 commits per gpuopt trial, a few
    ms each on SQLite. RDBStorage has a per-key helper that does not commit; there is no public
    batch call. Raises ImportError/AttributeError/TypeError when the internals moved.
    """
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    backend = unwrap_storage(storage)
    if not isinstance(backend, RDBStorage):
        return False
    with _create_scoped_session(backend.scoped_session, True) as session:
        for key, value in attrs.items():
            backend._set_trial_attr_without_commit(
                session, models.TrialUserAttributeModel, trial_id_, key, value
            )
    return True


def set_system_attr_and_beat(storage: Any, trial_id_: int, key: str, value: Any) -> bool:
    """A just-asked trial's system attr and its first heartbeat in one RDB transaction (what
    `set_trial_system_attr` and `record_heartbeat` do, one commit each: ~5 ms apiece per trial
    on SQLite); False when the storage is not an RDBStorage with heartbeats. Raises
    ImportError/AttributeError/TypeError when the internals moved."""
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    backend = unwrap_storage(storage)
    if not isinstance(backend, RDBStorage) or not backend.get_heartbeat_interval():
        return False
    with _create_scoped_session(backend.scoped_session, True) as session:
        backend._set_trial_attr_without_commit(
            session, models.TrialSystemAttributeModel, trial_id_, key, value
        )
        if models.TrialHeartbeatModel.where_trial_id(trial_id_, session) is None:
            session.add(models.TrialHeartbeatModel(trial_id=trial_id_))
    return True


# ---- hydra-optuna-sweeper ---------------------------------------------------------------------------


def stock_sweeper_impl() -> type:
    """hydra-optuna-sweeper's `OptunaSweeperImpl`: gpuopt's loop subclasses it for its setup
    (launcher, config) and its attributes. The plugin ships it only in its private `_impl`."""
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

    return OptunaSweeperImpl


def create_params_from_overrides(overrides: list[str]) -> tuple[dict, dict, list]:
    """Hydra sweep syntax (choice, range, interval, tag(log, ...)) -> Optuna distributions, fixed
    params and fixed overrides: the stock sweeper's parser, only in its private `_impl`."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides as create

    return create(overrides)


def grid_choices(distribution: Any) -> Any:
    """The grid values of a discrete distribution, as the stock sweeper gives them to GridSampler
    (a private staticmethod of OptunaSweeperImpl)."""
    return stock_sweeper_impl()._to_grid_sampler_choices(distribution)


# ---- hydra-submitit-launcher / submitit -----------------------------------------------------------


def submitit_executor_kind(launcher: Any) -> str | None:
    """ "local" or "slurm" for a hydra-submitit-launcher launcher (its private `_EXECUTOR` class
    attribute: nothing public says which one it is), None for any other launcher."""
    return getattr(launcher, "_EXECUTOR", None)


def local_executor_class(start: Callable[[Any, str, dict[str, Any]], Any]) -> type:
    """submitit's LocalExecutor, starting each job's controller with `start(folder, command,
    parameters)` (a Popen). submitit has no hook for how the controller starts (gpuopt needs a new
    session and its own controller): `_submit_command` is overridden, and the LocalJob built as
    submitit builds it."""
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
    """The Popen of a submitit LocalJob (None once unpickled): needed to kill its process group
    and read the controller's exit status; LocalJob keeps it private."""
    return job._process


def local_controller_class() -> type:
    """submitit's local job controller (`submitit.local.local.Controller`, undocumented): gpuopt's
    controller subclasses it to write the tasks' exit codes, which submitit keeps to itself."""
    from submitit.local.local import Controller

    return Controller


# ---- Hydra: the command line of a @hydra.main app -------------------------------------------------


def hydra_args_parser() -> Any:
    """Hydra's argparse parser of a `@hydra.main` app (`hydra._internal.utils.get_args_parser`):
    `python -m gpuopt.run` parses its arguments with it before Hydra does, to report a bad one in
    one line instead of argparse's usage block. Hydra has no public accessor for it."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def report_as_hydra(failure: BaseException) -> None:
    """Report an exception as `@hydra.main` does and exit 1 (`hydra._internal.utils.run_and_report`:
    the short message, or the traceback under HYDRA_FULL_ERROR=1). gpuopt's CLI catches Hydra's
    errors to print bad input as one line, and hands back here those that are not bad input; Hydra
    has no public function that reports one as it would."""
    from hydra._internal.utils import run_and_report

    def reraise() -> None:
        raise failure

    run_and_report(reraise)


def launcher_chosen(config_loader: Any, config: Any) -> bool:
    """Whether the app or its command line chose `hydra/launcher` (rather than leaving Hydra's
    default, `basic`): an `override hydra/launcher: ...` entry in any defaults list or a
    `hydra/launcher=...` override. Hydra keeps both in its defaults list's `overrides.
    override_choices` (hydra._internal.defaults_list.Overrides, not public API); the composed
    config's `hydra.runtime.choices` says `basic` either way."""
    from hydra.types import RunMode

    overrides = [*config.hydra.overrides.hydra, *config.hydra.overrides.task]
    defaults = config_loader.compute_defaults_list(
        config.hydra.job.config_name, [str(o) for o in overrides], RunMode.MULTIRUN
    )
    return "hydra/launcher" in defaults.overrides.override_choices


# ---- Hydra 1.4: what gpuopt's pin must not change in the user's own app ---------------------------
# gpuopt pins Hydra 1.4's release candidate (the only Hydra line whose Optuna sweeper runs on Optuna
# 4/5). Installed beside an app written for Hydra 1.3, two of 1.4's changes would reach that app:
# `_partial_` factories that refuse pickling (Lightning's `save_hyperparameters` then drops them,
# and lightning-hydra-template's `configure_optimizers` fails on `self.hparams.optimizer`), and a
# 7-line warning for every `_target_` an app instantiates without an execution whitelist.
# gpuopt.hydra_interop applies both adapters below in every Hydra app of the environment (Hydra
# loads plugins' entry points when it starts), so the app runs as it did on Hydra 1.3.

HYDRA_STATE_NOT_PICKLED = ("_hydra_execution_policy", "_hydra_call_context")  # this call's runtime


def picklable_hydra_partials() -> None:
    """Hydra 1.4's `_partial_: true` object (`hydra._internal.execution_policy._DeferredTarget`, a
    functools.partial subclass) pickles as a functools.partial does, as on Hydra 1.3: its class,
    target, arguments and the execution whitelist it was made under (so a call after unpickling is
    authorized as before), without the live call context of the process that made it. Hydra 1.4
    refuses ("cannot be pickled before invocation"); no public switch exists. Idempotent."""
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
    """Hydra 1.4's legacy-whitelist deprecation warning (`_instantiate2.
    _warn_legacy_execution_whitelist`, 7 lines for every `_target_` instantiated without a
    whitelist) said once per process in one warning: what it means and how to pass the app's
    whitelist. HYDRA_DEPRECATION_WARNINGS_AS_ERRORS keeps Hydra's own (it raises). Idempotent."""
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
