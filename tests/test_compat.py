"""Every private Optuna / Hydra / submitit internal gpuopt uses (gpuopt/core/_compat.py),
exercised against the installed libraries: an upgrade that moves one fails here, by name."""

from __future__ import annotations

import operator
import time

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from gpuopt.core import _compat
from gpuopt.study.keys import ATTR_HEARTBEAT


@pytest.fixture(params=["memory", "sqlite"])
def study(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}" if request.param == "sqlite" else None
    return optuna.create_study(storage=url, study_name="compat")


def test_storage_of_and_trial_id(study):
    trial = study.ask()
    storage = _compat.storage_of(study)
    assert isinstance(storage, optuna.storages.BaseStorage)
    tid = _compat.trial_id(trial)
    assert storage.get_trial(tid).number == trial.number
    study.tell(trial, 1.0)
    assert _compat.trial_id(study.trials[0]) == tid  # FrozenTrial too


def test_unwrap_storage_reaches_the_rdb_backend(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'u.db'}")
    backend = _compat.unwrap_storage(_compat.storage_of(study))
    assert isinstance(backend, optuna.storages.RDBStorage)
    memory = optuna.create_study()
    assert _compat.unwrap_storage(_compat.storage_of(memory)) is _compat.storage_of(memory)


def _heartbeat_study(tmp_path, interval=1, grace=1):
    with pytest.warns(optuna.exceptions.ExperimentalWarning):
        storage = optuna.storages.RDBStorage(
            f"sqlite:///{tmp_path / 'hb.db'}", heartbeat_interval=interval, grace_period=grace
        )
    return optuna.create_study(storage=storage)


def _until(condition, timeout_s: float = 30.0) -> bool:
    """Whether `condition()` comes true within `timeout_s`, polled: the storage's own clock says
    when a beat is past its grace (SQLite's CURRENT_TIMESTAMP, whole seconds), not a sleep of ours."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_heartbeat_interface_thread_and_stale_check(tmp_path):
    # grace 2 s, a beat every 1 s: the thread's beats keep a trial alive unless one is over a
    # second late; a trial asked beside it that only beat at its ask (`control`) says, on the
    # storage's clock, when the ask's beat alone would be stale
    study = _heartbeat_study(tmp_path, interval=1, grace=2)
    storage = _compat.storage_of(study)
    assert isinstance(storage, _compat.heartbeat_base())
    assert _compat.heartbeat_enabled(storage)
    assert not _compat.heartbeat_enabled(_compat.storage_of(optuna.create_study()))
    assert not _compat.heartbeat_enabled(None)
    with pytest.warns(UserWarning, match="Heartbeat"):
        trial, control = study.ask(), study.ask()
    sid = storage.get_study_id_from_name(study.study_name)
    tid, control_id = _compat.trial_id(trial), _compat.trial_id(control)
    for beaten in (tid, control_id):
        storage.record_heartbeat(beaten)  # the beat the sweeper records at the ask
    thread = _compat.heartbeat_thread(trial, storage)
    thread.start()  # no second beat at once: the first after one interval (1 s)
    assert _until(lambda: control_id in _compat.stale_trial_ids(storage, sid))
    # past the ask's beat + grace: alive only through the thread's beats
    assert _compat.stale_trial_ids(storage, sid) == [control_id]
    thread.join()
    assert _until(lambda: tid in _compat.stale_trial_ids(storage, sid))  # no beat since
    assert sorted(_compat.stale_trial_ids(storage, sid)) == sorted([tid, control_id])


def test_the_heartbeat_thread_does_not_beat_again_at_once(tmp_path):
    """A trial beats once when asked; its thread's first beat comes one interval later."""
    study = _heartbeat_study(tmp_path, interval=60, grace=120)
    storage = _compat.storage_of(study)
    with pytest.warns(UserWarning, match="Heartbeat"):
        trial = study.ask()
    beats = []
    storage.record_heartbeat = beats.append
    thread = _compat.heartbeat_thread(trial, storage)
    thread.start()
    time.sleep(0.2)
    thread.join()
    assert beats == []


def test_journal_heartbeat_hook_is_called_by_optuna(tmp_path):
    """Optuna's own fail_stale_trials reaches HeartbeatJournalStorage.stale_trial_ids through the
    private `_get_stale_trial_ids` (StaleTrialsByPublicName)."""
    from gpuopt.study.storage import open_storage

    storage = open_storage(f"journal://{tmp_path / 'j.log'}", 1, 1)
    study = optuna.create_study(storage=storage)
    with pytest.warns(UserWarning, match="Heartbeat"):
        trial = study.ask()
    storage.set_trial_system_attr(_compat.trial_id(trial), ATTR_HEARTBEAT, time.time() - 100)
    with pytest.warns(optuna.exceptions.ExperimentalWarning):
        optuna.storages.fail_stale_trials(study)
    assert study.trials[0].state == TrialState.FAIL


def test_user_attrs_in_one_transaction(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'a.db'}")
    trial = study.ask()
    attrs = {"status": "ok", "env": {"device": "cpu"}, "overrides": ["a=1"]}
    assert _compat.set_user_attrs_in_one_transaction(
        _compat.storage_of(study), _compat.trial_id(trial), attrs
    )
    assert study.trials[0].user_attrs == attrs
    memory = optuna.create_study()
    other = memory.ask()
    assert not _compat.set_user_attrs_in_one_transaction(
        _compat.storage_of(memory), _compat.trial_id(other), attrs
    )


def test_stock_sweeper_impl_parser_and_grid_choices():
    from hydra.plugins.sweeper import Sweeper

    impl = _compat.stock_sweeper_impl()
    assert issubclass(impl, Sweeper) and callable(impl.setup)
    dists, fixed, fixed_overrides = _compat.create_params_from_overrides(
        ["a=choice(1,2)", "b=range(1,6,step=2)", "c=interval(0.1,1.0)", "d=3", "~f"]
    )
    assert dists["a"] == CategoricalDistribution([1, 2])
    assert dists["b"] == IntDistribution(1, 5, step=2)
    assert dists["c"] == FloatDistribution(0.1, 1.0)
    assert fixed == {"d": "3"} and fixed_overrides == ["~f"]
    assert list(_compat.grid_choices(dists["a"])) == [1, 2]
    assert _compat.grid_choices(IntDistribution(1, 5, step=2)) == [1, 3, 5]
    with pytest.raises(ValueError, match="discrete"):
        _compat.grid_choices(dists["c"])


def test_grid_size_and_public_suggest_match_grid_sampler():
    """SearchSpace.grid_size (instead of GridSampler's private _all_grids) and search_space.suggest
    (instead of trial._suggest) behave as the sampler does."""
    from gpuopt.sweeper.space import build_search_space, suggest

    space = build_search_space({}, ["a=choice(1,2,3)", "b=range(0,2)"], None, grid=True)
    sampler = optuna.samplers.GridSampler(space.grid, seed=0)
    study = optuna.create_study(sampler=sampler)
    seen = []
    while len(study.trials) < 20:
        trial = study.ask()
        seen.append(tuple(suggest(trial, n, d) for n, d in space.distributions.items()))
        try:
            study.tell(trial, 1.0)
        except RuntimeError:  # GridSampler stops the study outside optimize()
            break
        if len(set(seen)) == space.grid_size and len(seen) == space.grid_size:
            break
    assert space.grid_size == 6 and len(set(seen)) == 6
    # an enqueued (fixed) param comes back as enqueued
    study = optuna.create_study()
    study.enqueue_trial({"a": 2})
    assert suggest(study.ask(), "a", CategoricalDistribution([1, 2, 3])) == 2


def test_submitit_executor_kind():
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher

    assert _compat.submitit_executor_kind(LocalLauncher) == "local"
    assert _compat.submitit_executor_kind(object()) is None


def test_local_executor_controller_and_job_process(tmp_path):
    """gpuopt's executor (its own controller start) runs a real job; the controller subclass
    writes the exit codes; the job's Popen is reachable."""
    import json

    from gpuopt.sweeper.launchers.fresh_process import (
        EXIT_CODES_SUFFIX,
        _controller,
        _start_controller,
    )

    assert issubclass(_controller(), _compat.local_controller_class())
    executor = _compat.local_executor_class(_start_controller)(folder=tmp_path)
    executor.update_parameters(timeout_min=2)
    job = executor.submit(operator.mul, 6, 7)
    assert job.result() == 42
    process = _compat.job_process(job)
    assert process is not None and process.wait(timeout=30) == 0
    codes = json.loads((job.paths.folder / f"{job.job_id}{EXIT_CODES_SUFFIX}").read_text())
    assert codes["codes"] == [0] and len(codes["pids"]) == 1  # each task's status and pid


def test_constraints_key_is_what_optuna_reads_as_constraints():
    import optuna
    from optuna.trial import TrialState, create_trial

    trial = create_trial(
        state=TrialState.COMPLETE,
        values=[1.0],
        system_attrs={_compat.constraints_key(): [1.0, 0.0]},
    )
    assert trial.constraints == {"0": 1.0, "1": 0.0}
    assert optuna.study._constrained_optimization._get_feasible_trials([trial]) == []


def test_hydra_args_parser_is_the_parser_of_a_hydra_app():
    args = _compat.hydra_args_parser().parse_args(["-m", "a=1", "b=2"])
    assert args.multirun is True and args.overrides == ["a=1", "b=2"]


def test_report_as_hydra_prints_the_short_message_and_exits_1(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exited:
        _compat.report_as_hydra(ValueError("a reason only"))
    assert exited.value.code == 1
    assert "a reason only" in capsys.readouterr().err


def test_owner_and_first_beat_in_one_transaction(tmp_path):
    """The sweeper's owner record and first heartbeat of a just-asked trial, one commit: both are
    there (the stale check sees a trial that beat once), and a storage without RDB heartbeats
    says it cannot (the caller writes them apart)."""
    study = _heartbeat_study(tmp_path)
    storage = _compat.storage_of(study)
    with pytest.warns(UserWarning, match="Heartbeat"):
        trial = study.ask()
    tid, sid = _compat.trial_id(trial), storage.get_study_id_from_name(study.study_name)
    assert _compat.set_system_attr_and_beat(storage, tid, "owner", {"pid": 1})
    assert storage.get_trial(tid).system_attrs["owner"] == {"pid": 1}
    assert _compat.stale_trial_ids(storage, sid) == []
    assert _until(lambda: _compat.stale_trial_ids(storage, sid) == [tid])  # no beat since
    memory = optuna.create_study()
    other = memory.ask()
    assert not _compat.set_system_attr_and_beat(
        _compat.storage_of(memory), _compat.trial_id(other), "k", 1
    )
