"""Scaling out: isolated trials, several workers on one study, heartbeats, GPU pinning, secrets.

Unit tests for the rules (pure functions, an in-process journal study); end-to-end tests start real
sweep processes (tests/sweep_helpers/fake_task.py: gpuopt's configs, a stand-in engine, no torch)
against a real PostgreSQL server (tests/helpers/postgres.py) or a journal file.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState, create_trial

from gpuopt.study import storage as storage_mod
from gpuopt.study.keys import ATTR_BASELINE
from gpuopt.study.records import FRESH_PROCESSES, read_confirmation
from gpuopt.study.rules import leading_trial
from gpuopt.sweeper import owners, resume
from gpuopt.sweeper.confirm.rounds import FRESH_LEVEL
from gpuopt.sweeper.launchers import gpus
from gpuopt.sweeper.launchers.results import describe_exit
from gpuopt.sweeper.objectives import outcome_from_return
from gpuopt.sweeper.progress import Progress, SweepAborted
from gpuopt.sweeper.record import outcome_of
from tests.helpers.postgres import find_pg_bin, postgres_server

HELPERS = Path(__file__).parent / "sweep_helpers"
FAKE = [
    "~search",
    "measure=quick",
    "hydra.sweeper.device_aware=false",
    "hydra.sweeper.confirm.rounds=0",
    "loader.batch_size=choice(8,16,32,64)",
    "loader.num_workers=choice(0,1,2)",
]
needs_pg = pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL server binaries not found")


# ---- rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "n_jobs", "expected"),
    [
        (["0", "1", "2", "3"], 4, ["0", "1", "2", "3"]),
        (["0", "1", "2", "3"], 2, ["0,1", "2,3"]),  # 2 GPUs per job
        (["0", "1", "2"], 2, ["0", "1"]),  # one GPU left over, never shared
        (["4", "7"], 2, ["4", "7"]),  # the ids this process was given, not 0..n
        (["GPU-a", "GPU-b"], 3, ["GPU-a", "GPU-b", "GPU-a"]),  # more jobs than GPUs: shared
        ([], 2, ["", ""]),
    ],
)
def test_gpu_assignment(visible, n_jobs, expected):
    assert [gpus.assign(visible, n_jobs, k) for k in range(n_jobs)] == expected


@pytest.mark.parametrize(
    ("environ", "nvml", "expected"),
    [
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, ["GPU-a"], ["2", "3"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, ["GPU-a"], []),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, ["GPU-a"], []),
        ({}, ["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"]),
        ({}, [], None),
    ],
)
def test_visible_gpus(environ, nvml, expected):
    assert gpus.pinnable_gpus(environ, lambda: nvml) == expected


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (-11, "killed by signal SIGSEGV"),
        (-6, "killed by signal SIGABRT"),
        (-9, "killed by signal SIGKILL"),  # the OOM killer's only with evidence (test_user_sweeps)
        (3, "exited with code 3 without a result"),
    ],
)
def test_describe_exit(code, text):
    assert describe_exit(code).startswith(text)


def _trial(number, state, **user_attrs):
    kw = {"values": [1.0]} if state == TrialState.COMPLETE else {}
    t = create_trial(state=state, user_attrs=user_attrs, **kw)
    t.number = number
    return t


C, F, W = TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING


@pytest.mark.parametrize(
    ("others", "number", "n_trials", "surplus"),
    [
        ([], 0, 1, False),
        ([(0, C, {}), (1, C, {})], 2, 2, True),
        ([(0, C, {}), (1, F, {})], 2, 3, False),  # an error trial counts, one slot left
        ([(0, C, {}), (1, F, {"interrupted": True})], 2, 2, False),  # interrupted: re-run
        ([(0, C, {}), (1, F, {"void": "surplus"})], 2, 2, False),  # void: never counted
        ([(0, C, {}), (1, W, {})], 2, 2, True),  # a lower queued trial runs first
        ([(0, C, {}), (3, C, {})], 2, 2, False),  # a higher number is behind, not ahead
    ],
)
def test_surplus_rule_counts_only_lower_numbers(others, number, n_trials, surplus):
    trials = [_trial(n, s, **a) for n, s, a in others]
    assert owners.is_surplus(number, trials, n_trials) is surplus


def test_duplicate_baseline_is_the_higher_number():
    trials = [_trial(0, W, **{ATTR_BASELINE: True}), _trial(1, W, **{ATTR_BASELINE: True})]
    assert not owners.duplicate_baseline(0, trials)
    assert owners.duplicate_baseline(1, trials)


def _owned(number, value, owner, state=TrialState.COMPLETE):
    t = create_trial(
        state=state,
        values=[value] if state == TrialState.COMPLETE else None,
        system_attrs={"gpuopt:owner": owner},
    )
    t.number = number
    if state == TrialState.RUNNING:
        t.datetime_complete = None
    return t


def test_progress_lines_tell_the_studys_count_best_and_pace_and_name_the_worker():
    """Worker B's line once the study holds 8 finished trials, best #2 (issue 25: B said `trial
    2/8 #8 ... | best #8`): the study's count, its best (not this worker's), which worker speaks."""
    me, other = owners.this_owner(), {"host": "hostA", "pid": 7}
    progress = Progress(9, ["throughput"], ["maximize"], t_start=time.monotonic())
    progress.start([])
    trials = [_owned(n, 100.0 if n == 2 else 10.0 + n, other) for n in range(7)]
    trials.append(_owned(7, 0.0, other, TrialState.RUNNING))  # A's, in flight: not finished
    trials.append(_owned(8, 50.0, me))
    outcome = outcome_from_return(50.0, ["throughput"], ["maximize"])
    line = progress.record(8, False, outcome, trials)
    assert line.startswith("trial 8/9 #8 ok: throughput=50")  # counted, finished trials
    assert "| best #2 throughput=100" in line
    assert line.endswith(f"| worker {owners.host_name()}:{os.getpid()}")
    # Alone on the study (another worker's trials all finished before this one started): no tag.
    alone = Progress(8, ["throughput"], ["maximize"], t_start=time.monotonic())
    alone.start([])
    before = [_owned(n, 1.0, other) for n in range(3)]
    for t in before:
        t.datetime_complete = alone.started_at - datetime.timedelta(seconds=5)
    line = alone.record(3, False, outcome, [*before, _owned(3, 50.0, me)])
    assert line.startswith("trial 4/8 #3 ok") and "worker" not in line


def test_a_stopped_sweep_shows_the_last_failure_and_names_only_storages_that_exist():
    def failing(storage):
        progress = Progress(4, ["value"], ["minimize"], t_start=time.monotonic())
        progress.start([])
        try:
            raise RuntimeError("cfg.error is True")
        except RuntimeError as exc:
            for n in range(3):
                progress.record(n, False, outcome_of(exc, ["value"], ["minimize"]), [])
        with pytest.raises(SweepAborted) as aborted:
            progress.check_failure_rate(0.5, "sphere", storage)
        return aborted.value

    memory = failing("memory")
    assert "--storage" not in str(memory) and "in memory and is not kept" in str(memory)
    lines = memory.failure.splitlines()
    assert lines[0] == "gpuopt: trial #2 failed:" and lines[1].startswith("Traceback")
    assert 'raise RuntimeError("cfg.error is True")' in memory.failure
    assert lines[-1] == "launcher: RuntimeError: cfg.error is True"
    kept = failing("sqlite:////tmp/s.db")
    assert "optuna trials --study-name sphere --storage sqlite:////tmp/s.db" in str(kept)


def test_storage_display_masks_the_password():
    url = "postgresql+psycopg://gpuopt:pa55word@db.example:5432/studies"
    assert storage_mod.display(url) == "postgresql+psycopg://gpuopt:***@db.example:5432/studies"
    assert storage_mod.display(None) == "memory"


def _failed_and_requeued(trials, number, reason_part):
    """Trial `number` is FAIL as interrupted with the reason, and queued once again: the re-run."""
    failed = trials[number]
    assert failed.state == TrialState.FAIL and failed.user_attrs["interrupted"] is True
    assert reason_part in failed.user_attrs["reason"]
    (rerun,) = [t for t in trials if t.user_attrs.get("rerun_of") == number]
    assert rerun.state == TrialState.WAITING
    return rerun


def test_journal_heartbeat_fails_a_silent_trial_once_and_requeues_it(tmp_path):
    spec = f"journal://{tmp_path / 'study.log'}"
    store = storage_mod.open_storage(spec, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="hb", storage=store)
    alive, dead = study.ask(), study.ask()
    alive.suggest_int("x", 0, 9)
    dead.suggest_int("x", 0, 9)
    store.record_heartbeat(alive._trial_id)
    store.set_trial_system_attr(dead._trial_id, storage_mod.ATTR_HEARTBEAT, time.time() - 10)
    # A second worker's view of the same file finds the same stale trial: only one fails it.
    other = optuna.load_study(
        study_name="hb",
        storage=storage_mod.open_storage(spec, heartbeat_interval=1, grace_period=2),
    )
    assert resume.fail_stale(study) == [dead.number]
    assert resume.fail_stale(other) == []
    trials = study.get_trials()
    rerun = _failed_and_requeued(trials, dead.number, "no heartbeat for over 2 s")
    assert trials[alive.number].state == TrialState.RUNNING
    assert rerun.system_attrs["fixed_params"] == dead.params


def test_a_trial_whose_worker_died_right_after_asking_is_failed_after_grace(tmp_path):
    """RDBStorage's stale check only sees trials that beat once; a worker killed between
    `study.ask()` and its first heartbeat leaves an ownerless RUNNING trial, timed by the watcher."""
    store = storage_mod.open_storage(
        f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1, grace_period=5
    )
    study = optuna.create_study(study_name="orphan", storage=store)
    study.enqueue_trial({"x": 3}, user_attrs={ATTR_BASELINE: True})
    orphan = study.ask()  # popped the queued baseline; its worker dies before suggesting anything
    live = study.ask()
    store.record_heartbeat(live._trial_id)
    store.set_trial_system_attr(live._trial_id, resume.ATTR_OWNER, owners.this_owner())
    assert resume.fail_stale(study) == []  # the gap: never beat, so never stale

    now = [100.0]
    watch = resume.Recovery(5, clock=lambda: now[0])
    assert watch.fail_dead(study) == []  # first seen now
    now[0] += 4.9
    assert watch.fail_dead(study) == []
    now[0] += 0.2
    assert watch.fail_dead(study) == [orphan.number]
    assert watch.fail_dead(study) == []

    trials = study.get_trials()
    rerun = _failed_and_requeued(trials, orphan.number, "ended before it started")
    assert trials[live.number].state == TrialState.RUNNING
    assert rerun.user_attrs[ATTR_BASELINE] is True
    assert rerun.system_attrs["fixed_params"] == {"x": 3}  # what it was enqueued with


def test_slurm_preset_composes_the_submitit_slurm_launcher():
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401  (registers the schema)

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(
            config_name="config",
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.timeout_min=30",
            ],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "gpuopt.sweeper.launchers.slurm.GpuoptSlurmLauncher"
    assert launcher.partition == "gpu" and launcher.timeout_min == 30
    assert launcher.gpus_per_task == 1 and launcher.tasks_per_node == 1
    assert launcher.cpus_per_task == 8 and launcher.mem_gb == 32
    assert launcher.array_parallelism == 4


# ---- end to end ---------------------------------------------------------------------------------


def _cmd(*args: str) -> list[str]:
    return [sys.executable, str(HELPERS / "fake_task.py"), "-m", *args]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path), "HYDRA_FULL_ERROR": "1", **extra}


def _run(tmp_path, *args, timeout=120, **env):
    proc = subprocess.run(
        _cmd(*args),
        cwd=tmp_path,
        env=_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _workers(tmp_path, n, args, env_per_worker=None):
    procs = []
    for i in range(n):
        out = open(tmp_path / f"worker{i}.log", "w")  # noqa: SIM115 - the worker writes to it after we return
        procs.append(
            subprocess.Popen(
                _cmd(*args),
                cwd=tmp_path,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(tmp_path, **((env_per_worker or {}).get(i, {}))),
                start_new_session=True,
            )
        )
    return procs


def _wait(procs, tmp_path, timeout=150, first=0):
    deadline = time.monotonic() + timeout
    for i, p in enumerate(procs, start=first):
        try:
            rc = p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"worker {i} hung:\n" + (tmp_path / f"worker{i}.log").read_text()[-3000:])
        assert rc == 0, (tmp_path / f"worker{i}.log").read_text()[-3000:]


def _assert_one_study_of(trials, n_trials):
    counted = [t for t in trials if owners.counted(t)]
    assert len(counted) == n_trials
    assert all(t.state == TrialState.COMPLETE for t in counted)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len({t.number for t in trials}) == len(trials)
    uncounted = [t for t in trials if not owners.counted(t)]  # void (surplus) or interrupted
    assert all(
        t.state == TrialState.FAIL and (t.user_attrs.get("void") or t.user_attrs.get("interrupted"))
        for t in uncounted
    )
    assert sum(bool(t.user_attrs.get(ATTR_BASELINE)) for t in counted) == 1
    return {t.system_attrs["gpuopt:owner"]["pid"] for t in counted}


@pytest.fixture(scope="module")
def pg_url():
    if find_pg_bin() is None:
        pytest.skip("PostgreSQL server binaries not found")
    with postgres_server() as url:
        yield url


@pytest.mark.slow
@needs_pg
@pytest.mark.parametrize("kind", ["postgres", "journal"])
def test_three_workers_share_one_study(tmp_path, kind, request):
    """One study, three workers, one story: each progress line counts the study's trials and
    names its worker; the confirming worker writes the final result, the others the best known
    so far marked `pending: <worker>` (each worker has its own sweep dir here), never an empty
    one."""
    storage = (
        request.getfixturevalue("pg_url")
        if kind == "postgres"
        else f"journal://{tmp_path}/study.log"
    )
    n_trials = 9
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    args = [
        *[a for a in FAKE if not a.startswith("hydra.sweeper.confirm.")],
        "hydra.sweeper.confirm.rounds=2",
        "hydra.sweeper.confirm.top_k=1",
        "hydra/launcher=basic",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweeper.study_name=three-{kind}",
        f"hydra.sweeper.n_trials={n_trials}",
        "model.sleep_s=0.3",
        # each trial (in its worker's process: the basic launcher) waits until two workers have
        # run one: the work is shared by construction, whatever the workers' start-up skew
        f"model.pid_dir={pid_dir}",
        "model.await_pids=2",
    ]
    dirs = {i: {"GPUOPT_OUTPUT_DIR": str(tmp_path / f"w{i}")} for i in range(3)}
    procs = _workers(tmp_path, 3, args, dirs)
    _wait(procs, tmp_path)
    store = storage_mod.open_storage(storage, None, None)
    study = optuna.load_study(study_name=f"three-{kind}", storage=store)
    trials = study.get_trials()
    pids = _assert_one_study_of(trials, n_trials)
    assert len(pids) >= 2  # the work was shared
    logs = [(tmp_path / f"worker{i}.log").read_text() for i in range(3)]
    assert all("gpuopt sweep summary" in text for text in logs)
    _assert_one_story(logs, [p.pid for p in procs], trials, n_trials)
    _assert_one_result(tmp_path, [p.pid for p in procs], study)


PROGRESS = re.compile(r"trial (\d+)/(\d+) #\d+.*?\| best #(\d+)[^|]*(?:\| worker (\S+))?$")


def _assert_one_story(logs, pids, trials, n_trials):
    """Every worker's lines count the study's trials; the last count names the study's best.
    The study's count, not the worker's own: no worker ran every trial (the caller checks the
    work was shared), yet a line counts them all. Two workers that read the study at once print
    the same count (how often is the machine's to say), so no count is owed a line of its own."""
    leader = leading_trial(trials, ["maximize", "maximize"]).number
    counts, tagged = [], 0
    for log, pid in zip(logs, pids, strict=True):
        mine = []
        for line in log.splitlines():
            m = PROGRESS.search(line)
            if not m:
                continue
            done, total, best, worker = int(m[1]), int(m[2]), int(m[3]), m[4]
            assert total == n_trials and 1 <= done <= n_trials, line
            mine.append(done)
            if done == n_trials:
                assert best == leader, line  # the study's best, whoever measured it
            if worker is not None:
                tagged += 1
                assert worker.endswith(f":{pid}"), line  # which worker speaks
        assert mine == sorted(mine), mine  # the study's count only grows
        counts += mine
    assert max(counts) == n_trials and len(counts) >= n_trials
    assert tagged


def _assert_one_result(tmp_path, pids, study):
    """The confirming worker's optimization_results.yaml is final; the others' are the Pareto
    front so far with `pending: <the confirming worker>`, and no best.yaml. The stand-in is a task
    of its own: confirmed in fresh processes (its launcher's runs), no shared measuring process."""
    confirmation = read_confirmation(study.user_attrs)
    assert confirmation is not None and confirmation.mode == FRESH_PROCESSES
    assert all(c.level == FRESH_LEVEL for c in confirmation.comparisons)  # its wider interval
    results = {}
    for i, pid in enumerate(pids):
        (path,) = (tmp_path / f"w{i}").glob("sweeps/*/*/optimization_results.yaml")
        assert not list(path.parent.glob("confirm/interleave.*"))  # no shared process's files
        results[pid] = (OmegaConf.load(path), (path.parent / "experiment" / "best.yaml").exists())
    final = [r for r, has_best in results.values() if "pending" not in r]
    assert final and all(has_best for r, has_best in results.values() if "pending" not in r)
    assert len(final) < len(results)  # the others finished while it confirmed
    best = final[0].best_trial
    assert all(r.best_trial == best for r in final)
    for pid, (r, has_best) in results.items():
        assert r.solutions and r.best_trial is not None  # never an empty result
        if "pending" in r:
            assert not has_best
            assert r.pending.endswith(tuple(f":{p}" for p in pids if p != pid)), r.pending


@pytest.mark.slow
@needs_pg
def test_a_killed_worker_is_failed_by_heartbeat_and_the_others_finish(tmp_path, pg_url):
    n_trials = 6
    name = "killed"
    args = [
        *FAKE,
        "hydra/launcher=basic",
        f"hydra.sweeper.storage={pg_url}",
        f"hydra.sweeper.study_name={name}",
        f"hydra.sweeper.n_trials={n_trials}",
        "hydra.sweeper.heartbeat_interval=1",
        "hydra.sweeper.grace_period=3",
        "model.sleep_s=1.5",
    ]
    # Distinct host names: the pid check cannot see the dead worker, only its heartbeat can.
    hosts = {i: {"GPUOPT_HOSTNAME": f"host{i}"} for i in range(3)}
    procs = _workers(tmp_path, 3, args, hosts)
    store = storage_mod.open_storage(pg_url, None, None)
    victim = procs[0]
    deadline = time.monotonic() + 60
    killed_trial = None
    while killed_trial is None and time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            trials = optuna.load_study(study_name=name, storage=store).get_trials(deepcopy=False)
        except KeyError:
            continue
        for t in trials:
            owner = t.system_attrs.get("gpuopt:owner") or {}
            if t.state == TrialState.RUNNING and owner.get("pid") == victim.pid and t.params:
                killed_trial = t.number
    assert killed_trial is not None, "worker 0 never ran a trial"
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    _wait(procs[1:], tmp_path, first=1)

    trials = optuna.load_study(study_name=name, storage=store).get_trials()
    dead = trials[killed_trial]
    assert dead.state == TrialState.FAIL and dead.user_attrs["interrupted"] is True
    assert "sent no heartbeat for over 3 s" in dead.user_attrs["reason"]
    assert "host0" in dead.user_attrs["reason"]
    rerun = [t for t in trials if t.user_attrs.get("rerun_of") == killed_trial]
    assert len(rerun) == 1 and rerun[0].state == TrialState.COMPLETE
    assert rerun[0].params == dead.params
    _assert_one_study_of(trials, n_trials)


@pytest.mark.slow
def test_segfault_abort_and_hang_are_recorded_and_the_sweep_goes_on(tmp_path):
    # The default launcher (fresh_process): every trial in its own process.
    proc = _run(
        tmp_path,
        "~search",
        "measure=quick",
        "hydra.sweeper.device_aware=false",
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.study_name=iso",
        "hydra.sweeper.max_failure_rate=1.0",
        "hydra.launcher.timeout_s=4",
        "model.case=choice(segfault,abort,hang)",
        timeout=180,
    )
    trials = optuna.load_study(
        study_name="iso", storage=f"sqlite:///{tmp_path / 'gpuopt.db'}"
    ).get_trials()
    assert trials[0].user_attrs[ATTR_BASELINE] and trials[0].state == TrialState.COMPLETE
    by = {t.params.get("model.case"): t for t in trials[1:]}
    assert all(
        t.state == TrialState.FAIL and t.user_attrs["status"] == "error" for t in by.values()
    )
    # The reason says how the process ended and the native crash faulthandler named, and where.
    segfault, abort = by["segfault"].user_attrs["reason"], by["abort"].user_attrs["reason"]
    assert segfault.startswith("killed by signal SIGSEGV: Fatal Python error: Segmentation fault")
    assert "Segmentation fault" in by["segfault"].user_attrs["traceback"]  # faulthandler, .err log
    assert abort.startswith("killed by signal SIGABRT: Fatal Python error: Aborted (File ")
    assert by["hang"].user_attrs["reason"].startswith("timed out after 4 s")
    assert "gpuopt sweep summary" in proc.stdout


@pytest.mark.slow
def test_parallel_trials_each_get_their_own_gpu(tmp_path):
    _run(
        tmp_path,
        *FAKE,
        "hydra.sweeper.study_name=gpus",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        timeout=180,
        CUDA_VISIBLE_DEVICES="5,7",
    )
    trials = optuna.load_study(
        study_name="gpus", storage=f"sqlite:///{tmp_path / 'gpuopt.db'}"
    ).get_trials()
    assert len(trials) == 4
    for t in trials:
        seen = t.user_attrs["env"]["cuda_visible_devices"]  # what the trial process saw
        assert seen == t.user_attrs["cuda_visible_devices"]  # what the sweeper recorded
    pairs = [{t.user_attrs["cuda_visible_devices"] for t in trials[i : i + 2]} for i in (0, 2)]
    assert pairs == [{"5", "7"}, {"5", "7"}]  # each batch: one trial per GPU


@pytest.mark.slow
@needs_pg
@pytest.mark.parametrize(
    ("launcher", "form"), [("basic", "user:password@host"), ("fresh_process", "?password=")]
)
def test_storage_password_is_never_written(tmp_path, pg_url, launcher, form):
    """A real role that must log in with its real (random) password (scram-sha-256 over TCP,
    tests/helpers/postgres.py), given in the URL's user info or its query string, percent-encoded
    (it holds an `@`). Every file the sweep wrote (the sweep log, summary.txt,
    optimization_results.yaml, every trial's .hydra/, submitit's job pickles with fresh_process),
    read as bytes, and every row of the study's tables: no trace of it. The same URL in
    `hydra.job.env_set` (a secret the trial needs) reaches the trial through its environment."""
    import hashlib
    import secrets

    import psycopg

    from tests.helpers.postgres import PASSWORD_LOGIN

    token = secrets.token_hex(12)
    password = f"pw-{token}@x"  # the `@` is %40 in the URL
    role = f"sweeper_{launcher}"
    conninfo = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}' IN ROLE {PASSWORD_LOGIN}")
        conn.execute(f"CREATE DATABASE {role} OWNER {role}")
    host = pg_url.split("@", 1)[1].rsplit("/", 1)[0]
    encoded = password.replace("@", "%40")
    url, shown = (
        (f"postgresql+psycopg://{role}:{encoded}@{host}/{role}", f"{role}:***@{host}")
        if form == "user:password@host"
        else (f"postgresql+psycopg://{role}@{host}/{role}?password={encoded}", "?password=***")
    )
    proc = _run(
        tmp_path,
        *FAKE,
        f"hydra/launcher={launcher}",
        f"hydra.sweeper.storage='{url}'",
        "hydra.sweeper.study_name=secret",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.max_failure_rate=1.0",
        "model.case=choice(crash,ok)",
        f"+hydra.job.env_set.GPUOPT_TEST_DSN='{url}'",  # a secret the trial needs: handed over
        "model.env_digest=GPUOPT_TEST_DSN",
    )
    report = subprocess.run(
        [sys.executable, "-m", "gpuopt.report", "--study", "secret", "--storage", url],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    assert shown in proc.stdout  # the summary names the storage, masked
    for text in (proc.stdout, proc.stderr, report.stdout, report.stderr):
        assert token not in text
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"hydra.yaml", "summary.txt", "optimization_results.yaml"} <= names, names
    assert any(p.suffix == ".log" for p in files)
    if launcher == "fresh_process":
        assert any(p.name.endswith("_submitted.pkl") for p in files)
        assert any(p.name.endswith("_result.pkl") for p in files)
    for path in files:
        assert token.encode() not in path.read_bytes(), path
    with psycopg.connect(f"{conninfo.rsplit('/', 1)[0]}/{role}") as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchall()
        assert {"studies", "trials", "trial_user_attributes"} <= {t for (t,) in tables}
        for (table,) in tables:
            rows = conn.execute(f'SELECT t::text FROM "{table}" t').fetchall()
            assert token not in repr(rows), table
    ok = [t for t in optuna.load_study(study_name="secret", storage=url).trials if t.values]
    digest = hashlib.sha256(url.encode()).hexdigest()
    assert ok and all(t.user_attrs["env"]["digest"] == digest for t in ok)  # the trial had it


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_terminated_sweep_takes_its_running_trial_down_and_resumes(tmp_path):
    """SIGTERM to the sweep kills the fresh-process trial too (it runs in a session of its own, so
    no signal reaches it otherwise); a re-run marks the trial interrupted and completes the study."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    args = (
        "~search",
        "measure=quick",
        "hydra.sweeper.device_aware=false",
        "hydra.sweeper.study_name=term",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.confirm.rounds=0",
        f"model.pid_dir={pid_dir}",
    )
    sweep = subprocess.Popen(
        _cmd(*args, "model.sleep_s=60"),
        cwd=tmp_path,
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 90
    while not any(pid_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    (trial_pid,) = [int(p.name) for p in pid_dir.iterdir()]
    assert _alive(trial_pid)
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(timeout=30) != 0
    deadline = time.monotonic() + 10
    while _alive(trial_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(trial_pid), "the trial process outlived the terminated sweep"

    _run(tmp_path, *args)
    trials = optuna.load_study(
        study_name="term", storage=f"sqlite:///{tmp_path / 'gpuopt.db'}"
    ).trials
    interrupted = [t for t in trials if t.user_attrs.get("interrupted")]
    assert len(interrupted) == 1 and interrupted[0].state == TrialState.FAIL
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2


@pytest.mark.slow
def test_a_resumed_sweep_reruns_a_trial_left_ownerless_by_a_dead_worker(tmp_path):
    args = (
        *FAKE,
        "hydra/launcher=basic",
        "hydra.sweeper.study_name=ownerless",
        "hydra.sweeper.heartbeat_interval=1",
        "hydra.sweeper.grace_period=2",
    )
    _run(tmp_path, *args, "hydra.sweeper.n_trials=2")
    storage = f"sqlite:///{tmp_path / 'gpuopt.db'}"
    dead = optuna.load_study(study_name="ownerless", storage=storage).ask()  # and nothing after

    _run(tmp_path, *args, "hydra.sweeper.n_trials=4", timeout=90)
    trials = optuna.load_study(study_name="ownerless", storage=storage).get_trials()
    assert trials[dead.number].state == TrialState.FAIL
    assert "ended before it started" in trials[dead.number].user_attrs["reason"]
    _assert_one_study_of(trials, 4)
