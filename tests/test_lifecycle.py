"""Killed, paused and interrupted sweeps; crash diagnostics; constraints as Optuna's tools read them.

Rules on in-process studies first; then end-to-end sweeps of tests/sweep_helpers/fake_task.py (no
torch) on the default fresh_process launcher, each bounded to a few seconds of trial time.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from optuna.trial import TrialState, create_trial

from gpuopt.core import lifeline
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.study import storage as storage_mod
from gpuopt.sweeper import outputs, owners, resume, summary
from gpuopt.sweeper.confirm.schedule import Pending
from gpuopt.sweeper.launchers.results import (
    attach_diagnostics,
    excerpt,
    log_excerpt,
    with_traceback,
)
from gpuopt.sweeper.objectives import outcome_from_return
from gpuopt.sweeper.record import record_trial
from gpuopt.sweeper.trials import overlapping
from tests.helpers.sweep_outputs import sweep_identity

HELPERS = Path(__file__).parent / "sweep_helpers"
QUICK = ["~search", "measure=quick", "hydra.sweeper.device_aware=false"]


# ---- the trial's lifeline -------------------------------------------------------------------------


def test_watchdog_ends_a_trial_whose_sweep_is_gone_or_whose_deadline_passed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = lifeline.SweepProcess(dead.pid, None, -1)
    assert "ended" in lifeline.watchdog_verdict(gone, deadline=1e18, now=0.0)
    me = lifeline.SweepProcess.this()
    assert lifeline.watchdog_verdict(me, deadline=10.0, now=5.0) is None
    assert "timed out" in lifeline.watchdog_verdict(me, deadline=10.0, now=11.0)
    # A reused pid (another start time) is not the sweep.
    assert not lifeline.process_alive(os.getpid(), (me.start or 0) + 1)
    log = "...\n" + lifeline.MARKER + "timed out after 3 s (hydra.launcher.timeout_s)\n"
    assert lifeline.reason_from_log(log).startswith("timed out after 3 s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_parent_death_signal_kills_the_child_of_a_killed_parent(tmp_path):
    """The trial's prctl(PR_SET_PDEATHSIG): its parent (submitit's controller) dies, it dies."""
    pid_file = tmp_path / "child.pid"
    child_code = (
        "import os, time\n"
        "from gpuopt.core.lifeline import set_parent_death_signal\n"
        "assert set_parent_death_signal()\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child_code!r}])\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    assert _gone_within(child, 5), "the child outlived its SIGKILLed parent"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


# ---- diagnostics ----------------------------------------------------------------------------------


def test_log_excerpt_keeps_head_and_tail_and_masks_secrets(tmp_path):
    text = "Fatal Python error: Segmentation fault\n" + "x" * 10_000 + "\nlast frame\n"
    (tmp_path / "err").write_text(text + "postgresql://u:pw@h/db\n")
    out = log_excerpt(tmp_path / "err")
    assert out.startswith("Fatal Python error: Segmentation fault")
    assert out.rstrip().endswith("postgresql://u:***@h/db") and "last frame" in out
    assert "chars cut ...]" in out and len(out) < 6200
    assert excerpt("short") == "short"


class _Paths:
    def __init__(self, folder: Path) -> None:
        self.stdout, self.stderr = folder / "0_log.out", folder / "0_log.err"
        self.stdout.write_text("")
        self.stderr.write_text("")


class _Job:
    def __init__(self, folder: Path) -> None:
        self.paths = _Paths(folder)


def test_a_raising_task_keeps_its_frames_and_an_error_result_its_logged_traceback(tmp_path):
    def user_code():
        raise ValueError("bad shape")

    try:
        user_code()
    except ValueError as exc:
        failed = JobReturn(overrides=[], status=JobStatus.FAILED)
        failed.return_value = exc
    ret = with_traceback(failed)  # in the trial process, before pickling drops the frames
    job = _Job(tmp_path)
    attach_diagnostics(ret, job, "/runs/7")
    diag = ret.gpuopt_diagnostics
    assert "user_code" in diag.traceback and "ValueError: bad shape" in diag.traceback
    assert diag.run_dir == "/runs/7" and diag.logs == [str(job.paths.stdout), str(job.paths.stderr)]

    # gpuopt's engine catches the error, logs it, returns an error TrialResult: no exception here.
    job.paths.stdout.write_text(
        "[INFO] start\n[WARNING] trial failed\nTraceback (most recent call last):\n"
        '  File "model.py", line 3, in forward\nValueError: bad shape\n'
    )
    ok = JobReturn(overrides=[], status=JobStatus.COMPLETED, _return_value=None)
    attach_diagnostics(ok, job, None)
    assert ok.gpuopt_diagnostics.traceback.startswith("Traceback")
    assert "model.py" in ok.gpuopt_diagnostics.traceback


def test_an_error_trial_records_traceback_logs_and_run_dir(tmp_path):
    study = optuna.create_study(directions=["maximize", "maximize"])
    trial = study.ask()
    result = TrialResult(status=Status.ERROR, reason="ValueError: bad shape")
    ret = JobReturn(overrides=[], status=JobStatus.COMPLETED, _return_value=result)
    job = _Job(tmp_path)
    job.paths.stdout.write_text("Traceback (most recent call last):\nValueError: bad shape\n")
    attach_diagnostics(ret, job, str(tmp_path / "3"))
    outcome = outcome_from_return(result, ["throughput", "utilization"], ["maximize"] * 2)
    record_trial(study, trial, [], ret, outcome)
    attrs = study.trials[0].user_attrs
    assert "ValueError: bad shape" in attrs["traceback"]
    assert attrs["logs"] == [str(job.paths.stdout), str(job.paths.stderr)]
    assert attrs["run_dir"] == str(tmp_path / "3")


# ---- constraints, as optuna-dashboard reads them --------------------------------------------------


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_optuna_dashboard_sees_oom_as_infeasible(tmp_path):
    dashboard = pytest.importorskip("optuna_dashboard", reason="the `dashboard` extra")
    url = f"sqlite:///{tmp_path / 'd.db'}"
    names, directions = ["throughput"], ["maximize"]
    study = optuna.create_study(study_name="d", storage=url, directions=directions)
    ok = TrialResult(status=Status.OK, metrics=Metrics(throughput=100.0))
    oom = TrialResult(status=Status.OOM, reason="out of memory")
    for result in (ok, oom):
        trial = study.ask()
        ret = JobReturn(overrides=[], status=JobStatus.COMPLETED, _return_value=result)
        record_trial(study, trial, [], ret, outcome_from_return(result, names, directions))
    # Optuna's own reading: the oom trial is infeasible, the best is the ok one.
    assert [t.constraints for t in study.trials] == [
        {"0": 0.0, "1": 0.0, "2": 0.0},
        {"0": 1.0, "1": 0.0, "2": 0.0},
    ]
    assert study.best_trial.number == 0

    server = make_server("127.0.0.1", 0, dashboard.wsgi(url), handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        with urllib.request.urlopen(f"{base}/api/studies", timeout=30) as response:
            (summary,) = json.load(response)["study_summaries"]
        with urllib.request.urlopen(f"{base}/api/studies/{summary['study_id']}", timeout=30) as r:
            detail = json.load(r)
    finally:
        server.shutdown()
        server.server_close()
    constraints = {t["number"]: t["constraints"] for t in detail["trials"]}
    assert constraints == {
        0: [0.0, 0.0, 0.0],
        1: [1.0, 0.0, 0.0],
    }  # the dashboard's "infeasible" input
    assert [t["number"] for t in detail["best_trials"]] == [0]


# ---- several workers ------------------------------------------------------------------------------


def _owned(number, host, pid, start, end, state=TrialState.COMPLETE):
    t = create_trial(
        state=state,
        values=[1.0] if state == TrialState.COMPLETE else None,
        system_attrs={resume.ATTR_OWNER: {"host": host, "pid": pid}},
    )
    t.number, t.datetime_start = number, start
    t.datetime_complete = end if state == TrialState.COMPLETE else None
    return t


def test_interference_is_overlap_with_another_worker_on_the_same_host():
    t0 = dt.datetime(2026, 1, 1, 12, 0, 0)
    s = dt.timedelta(seconds=1)
    me = _owned(0, "a", 1, t0, None, TrialState.RUNNING)
    others = [
        _owned(1, "a", 2, t0 - 5 * s, t0 + s),  # other worker, same host, overlapping
        _owned(2, "a", 2, t0 - 9 * s, t0 - 6 * s),  # other worker, before this trial
        _owned(3, "b", 3, t0, t0 + 3 * s),  # other host
        _owned(4, "a", 1, t0, t0 + 2 * s),  # this worker's own batch
        _owned(5, "a", 4, t0 + s, None, TrialState.RUNNING),  # running now, same host
    ]
    assert overlapping(me, [me, *others], now=t0 + 4 * s) == [1, 5]
    attr = {"host": "a", "trials": [1, 5]}
    flagged = create_trial(
        state=TrialState.COMPLETE, values=[1.0], user_attrs={"interference": attr}
    )
    assert "host a" in summary.interference_note([flagged])
    assert summary.interference_note(others) is None


def test_a_worker_notices_its_trial_was_failed_as_stale_elsewhere(tmp_path):
    store = storage_mod.open_storage(
        f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval=1, grace_period=2
    )
    study = optuna.create_study(study_name="p", storage=store)
    mine, other = study.ask(), study.ask()
    now = [0.0]
    watch = resume.FinishedElsewhere(study, [mine, other], interval_s=1.0, clock=lambda: now[0])
    assert watch.reason(0) is None
    # Another worker, seeing no heartbeat for grace_period, fails it (and re-queues its params).
    assert resume.fail_and_requeue(study, study.trials[mine.number], "interrupted: stale")
    now[0] += 0.5
    assert watch.reason(0) is None  # read at most once per interval
    now[0] += 0.6
    assert "failed as stale by another worker" in watch.reason(0)
    assert watch.reason(1) is None


# ---- the trial loop on a shared study: what it reads, what it notices ----------------------------


class _Launcher:
    """Hydra's launcher as the trial loop calls it: each job returns 1.0 at once; `during(batch,
    first_number)` runs while the batch "runs" (what another worker does meanwhile)."""

    def __init__(self, during=None):
        self.during, self.batches = during, 0

    def launch(self, overrides, initial_job_idx):
        if self.during is not None:
            self.during(self.batches, initial_job_idx)
        self.batches += 1
        return [
            JobReturn(overrides=o, status=JobStatus.COMPLETED, _return_value=1.0) for o in overrides
        ]


def _shared_study(tmp_path):
    """A study on SQLite with heartbeats (the stale check runs between batches), and the storage."""
    store = storage_mod.open_storage(
        f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval=1, grace_period=2
    )
    sampler = optuna.samplers.RandomSampler(seed=0)
    return optuna.create_study(study_name="loop", storage=store, sampler=sampler), store


def _runner(n_trials, launcher=None, n_jobs=1, files=None):
    from gpuopt.sweeper.options import SweeperOptions
    from gpuopt.sweeper.trials import TrialRunner

    return TrialRunner(
        launcher=launcher,
        options=SweeperOptions.build(n_jobs=n_jobs, heartbeat_interval=1),
        config=OmegaConf.create({}),
        n_trials=n_trials,
        storage_text="sqlite",
        recovery=resume.Recovery(60),
        files=files,
    )


def _run_loop(study, n_trials, launcher, n_jobs=1, files=None):
    from optuna.distributions import FloatDistribution

    from gpuopt.sweeper.progress import Progress
    from gpuopt.sweeper.space import SearchSpace

    space = SearchSpace({"x": FloatDistribution(-1.0, 1.0)}, {}, [])
    progress = Progress(n_trials, ["value"], ["minimize"], t_start=time.monotonic())
    _runner(n_trials, launcher, n_jobs, files).run(study, n_trials, space, progress)


STORAGE_READS = (
    "get_all_trials",
    "get_trial",
    "get_trial_system_attrs",
    "get_trial_user_attrs",
    "get_trial_params",
    "get_study_id_from_name",
)


def _count_gpuopt_reads(study):
    """Count the study reads gpuopt's own code makes (the caller's module is gpuopt.*): whole-study
    `get_trials` and the storage's read methods; Optuna's reads inside ask/tell are not counted."""
    from collections import Counter

    from gpuopt.core._compat import storage_of

    counts: Counter[str] = Counter()

    def counting(name, read):
        def wrapper(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("gpuopt."):
                counts[name] += 1
            return read(*args, **kwargs)

        return wrapper

    study.get_trials = counting("get_trials", study.get_trials)
    storage = storage_of(study)
    for name in STORAGE_READS:
        setattr(storage, name, counting(name, getattr(storage, name)))
    return counts


@pytest.mark.parametrize(("n_jobs", "per_batch"), [(1, 2), (3, 5)])
def test_the_trial_loop_reads_the_study_once_after_a_launch_and_once_per_tell(
    tmp_path, n_jobs, per_batch
):
    """Per batch: one read after the launch (failed as stale elsewhere? interference), one after
    each tell (the progress line, then the next batch's recovery, count and ask), one more when a
    batch asks several (its own trials are not in the snapshot); no single-trial read, the study's
    id looked up once. Each read is a storage query: a read added back to the loop fails here."""
    study, _ = _shared_study(tmp_path)
    reads = _count_gpuopt_reads(study)
    _run_loop(study, 6, _Launcher(), n_jobs=n_jobs)
    trials = optuna.load_study(study_name="loop", storage=study._storage).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6
    assert reads["get_trials"] == 1 + per_batch * (6 // n_jobs)  # 1: the start
    assert reads["get_study_id_from_name"] == 1
    assert sum(reads.values()) == reads["get_trials"] + 1, reads


def test_the_trial_loop_drops_a_trial_failed_as_stale_elsewhere_and_runs_its_rerun(
    tmp_path, caplog
):
    study, _ = _shared_study(tmp_path)

    def during(batch, number):
        if batch == 0:  # another worker, seeing no heartbeat for grace_period, fails it
            assert resume.fail_and_requeue(study, study.trials[number], "interrupted: stale")

    with caplog.at_level("WARNING", logger="gpuopt.sweeper"):
        _run_loop(study, 1, _Launcher(during))
    first, rerun = study.get_trials()
    assert first.state == TrialState.FAIL and first.user_attrs["interrupted"]
    assert first.user_attrs["reason"] == "interrupted: stale"  # not overwritten by this worker
    assert rerun.state == TrialState.COMPLETE and rerun.user_attrs["rerun_of"] == 0
    assert rerun.params == first.params
    assert "#0 was failed as stale by another worker" in caplog.text


def test_the_trial_loop_flags_another_workers_trial_beside_its_own_and_counts_it_once_told(
    tmp_path, caplog
):
    """Another worker on this host starts a trial while this one runs (interference: read after
    the launch) and tells it while this one records (the progress line: read after the tell)."""
    study, store = _shared_study(tmp_path)
    other = optuna.load_study(study_name="loop", storage=store)
    ppid = os.getppid()  # a live process of this host: the other worker
    owner = {"host": owners.host_name(), "pid": ppid, "start": lifeline.start_ticks(ppid)}
    theirs = []

    def during(batch, number):
        if batch == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Heartbeat ... used with Study.optimize"
                theirs.append(other.ask())
            other._storage.set_trial_system_attr(theirs[0]._trial_id, resume.ATTR_OWNER, owner)

    class Files:  # the artifact upload: after the interference check, before the tell
        def upload_trial(self, study, trial, ret, outcome):
            if trial.number == 0:
                other.tell(theirs[0], 5.0)

    with caplog.at_level("INFO", logger="gpuopt.sweeper"):
        _run_loop(study, 3, _Launcher(during), files=Files())
    mine, _, last = study.get_trials()
    assert mine.user_attrs["interference"]["trials"] == [1]
    assert "interference" not in last.user_attrs  # #1 had ended before #2 started
    lines = [m for r in caplog.records if re.match(r"trial \d+/", m := r.getMessage())]
    assert lines[0].startswith("trial 2/3 #0") and lines[0].endswith(
        f"| worker {owners.host_name()}:{os.getpid()}"
    )
    assert lines[1].startswith("trial 3/3 #2")


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_recovery_on_a_snapshot_fails_a_stale_trial_newer_than_it_once(tmp_path):
    """`Recovery.recover` given the loop's snapshot: the stale check asks the storage, and a stale
    trial missing from the snapshot is read anew, failed and re-queued once; it says so."""
    spec = f"journal://{tmp_path / 'study.log'}"
    store = storage_mod.open_storage(spec, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="hb", storage=store)
    before = study.get_trials(deepcopy=False)  # read before the trial below existed
    dead = study.ask()
    dead.suggest_int("x", 0, 9)
    store.set_trial_system_attr(dead._trial_id, storage_mod.ATTR_HEARTBEAT, time.time() - 10)
    watch = resume.Recovery(60)
    assert watch.recover(study, before) is True
    trials = study.get_trials()
    assert trials[dead.number].state == TrialState.FAIL
    assert trials[dead.number].user_attrs["interrupted"] is True
    (rerun,) = [t for t in trials if t.user_attrs.get("rerun_of") == dead.number]
    assert rerun.state == TrialState.WAITING and rerun.system_attrs["fixed_params"] == dead.params
    assert watch.recover(study, study.get_trials(deepcopy=False)) is False


def test_an_ask_is_judged_on_the_snapshot_only_when_a_fresh_read_would_agree(tmp_path):
    """`_counting`: a snapshot read before the ask that holds every lower-numbered trial and finds
    the trial not surplus stands (those trials can only stop counting); a surplus verdict is read
    again (a trial ahead may have died since), and so is an ask past the snapshot's trials."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'c.db'}")  # no heartbeats
    runner = _runner(n_trials=1)
    ahead = study.ask()
    study._storage.set_trial_system_attr(ahead._trial_id, resume.ATTR_OWNER, owners.this_owner())
    before = study.get_trials(deepcopy=False)  # #0 running, its owner alive: counted
    assert resume.fail_and_requeue(study, before[0], "interrupted: stale")  # ... then failed
    trial = study.ask()  # pops #0's re-run: #1, with #0 in the snapshot
    judged = runner._counting(study, trial, before)
    assert judged is not before and not owners.is_surplus(trial.number, judged, 1)
    roomy = _runner(n_trials=3)
    assert roomy._counting(study, trial, before) is before  # 1 ahead < 3: stands
    later = study.ask()  # #2: #1 is not in `before`
    assert roomy._counting(study, later, before) is not before


def test_a_worker_that_does_not_confirm_publishes_the_best_so_far_marked_pending(tmp_path):
    """Never an empty stock result: the best known so far, `pending: <worker>`, no best.yaml; the
    confirming worker's final file is not replaced by a pending one (a shared sweep dir)."""
    study = optuna.create_study(directions=["maximize"])
    study.add_trial(create_trial(state=TrialState.COMPLETE, values=[5.0], params={}))
    identity = sweep_identity(tmp_path)
    where = Pending(("h:42",), "the confirmation runs in worker h:42")
    text = outputs.write_outputs(study, identity, None, 1.0, best_pending=where)
    assert f"best: pending: {where.text}; best so far #0: throughput=5" in text
    assert not (tmp_path / "experiment" / "best.yaml").exists()
    results = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert results.best_trial == 0 and results.best_value == 5.0 and results.pending == "h:42"
    text = outputs.write_outputs(study, identity, None, 1.0)  # the confirming worker
    assert "best      #0" in text and (tmp_path / "experiment" / "best.yaml").exists()
    assert "pending" not in OmegaConf.load(tmp_path / "optimization_results.yaml")
    outputs.write_outputs(study, identity, None, 1.0, best_pending=where)  # late: keeps the final
    assert "pending" not in OmegaConf.load(tmp_path / "optimization_results.yaml")


def test_a_pending_multi_objective_worker_writes_the_pareto_front_so_far(tmp_path, caplog):
    study = optuna.create_study(directions=["maximize", "maximize"])
    for values in ([5.0, 1.0], [1.0, 5.0], [0.5, 0.5]):
        study.add_trial(create_trial(state=TrialState.COMPLETE, values=values, params={}))
    identity = sweep_identity(tmp_path, "throughput", "utilization")
    with caplog.at_level("INFO", logger="gpuopt.sweeper"):
        outputs.write_outputs(study, identity, None, 1.0, best_pending=Pending(("h:42",), "x"))
    results = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert sorted(tuple(s["values"]) for s in results.solutions) == [(1.0, 5.0), (5.0, 1.0)]
    assert results.pending == "h:42"
    assert "Number of Pareto solutions: 2" in caplog.text


# ---- end to end -----------------------------------------------------------------------------------


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    out = open(tmp_path / "sweep.log", "w")  # noqa: SIM115 - the sweep writes to it
    return subprocess.Popen(
        [sys.executable, str(HELPERS / "fake_task.py"), "-m", *QUICK, *args],
        cwd=tmp_path,
        env={**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path)},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _trial_pid(pid_dir: Path, sweep: subprocess.Popen, timeout: float = 90) -> int:
    deadline = time.monotonic() + timeout
    while not any(pid_dir.iterdir()):
        if time.monotonic() > deadline or sweep.poll() is not None:
            os.killpg(sweep.pid, signal.SIGKILL)
            pytest.fail("the trial never started")
        time.sleep(0.1)
    return int(next(pid_dir.iterdir()).name)


def _trials(tmp_path: Path, name: str):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'gpuopt.db'}").trials


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_a_killed_sweep_takes_its_hanging_trial_down(tmp_path, sig):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    sweep = _start(
        tmp_path,
        f"hydra.sweeper.study_name=k{int(sig)}",
        "hydra.sweeper.n_trials=1",
        "hydra.launcher.timeout_s=40",
        "model.case=hang",
        f"model.pid_dir={pid_dir}",
    )
    trial = _trial_pid(pid_dir, sweep)
    sweep.send_signal(sig)
    sweep.wait(timeout=30)
    assert _gone_within(trial, 5), f"the trial outlived a {sig.name}ed sweep"
    if sig == signal.SIGHUP:  # a closed terminal: stopped like SIGTERM, trial marked at once
        (t,) = _trials(tmp_path, f"k{int(sig)}")[:1]
        assert t.state == TrialState.FAIL and t.user_attrs["interrupted"] is True


@pytest.mark.slow
def test_a_trial_ends_at_its_own_timeout_while_its_sweep_is_stopped(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    sweep = _start(
        tmp_path,
        "hydra.sweeper.study_name=stopped",
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.baseline=false",
        "hydra.sweeper.max_failure_rate=1.0",
        "hydra.launcher.timeout_s=3",
        "model.case=hang",
        f"model.pid_dir={pid_dir}",
    )
    trial = _trial_pid(pid_dir, sweep)
    os.killpg(sweep.pid, signal.SIGSTOP)  # the sweep cannot enforce anything now
    try:
        assert _gone_within(trial, 10), "the trial outlived its own timeout_s"
    finally:
        os.killpg(sweep.pid, signal.SIGCONT)
    assert sweep.wait(timeout=60) == 0, (tmp_path / "sweep.log").read_text()[-3000:]
    (t,) = _trials(tmp_path, "stopped")
    assert t.user_attrs["status"] == "error" and "timed out after 3 s" in t.user_attrs["reason"]


@pytest.mark.slow
def test_sigterm_marks_the_running_trial_interrupted_at_once_in_one_line(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    sweep = _start(
        tmp_path,
        "hydra.sweeper.study_name=term",
        "hydra.sweeper.n_trials=1",
        "model.case=hang",
        f"model.pid_dir={pid_dir}",
    )
    trial = _trial_pid(pid_dir, sweep)
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(timeout=30) == 143
    assert _gone_within(trial, 5)
    log = (tmp_path / "sweep.log").read_text()
    assert "Traceback" not in log
    (line,) = [x for x in log.splitlines() if x.startswith("gpuopt: sweep stopped")]
    assert "signal SIGTERM" in line and "marked interrupted" in line
    trials = _trials(tmp_path, "term")
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs["interrupted"] is True
    assert "sweep was stopped (signal SIGTERM)" in trials[0].user_attrs["reason"]
    assert [t.user_attrs.get("rerun_of") for t in trials[1:]] == [0]  # re-queued
    assert trials[1].state == TrialState.WAITING


@pytest.mark.slow
def test_crash_diagnostics_keep_the_fatal_error_the_logs_and_the_run_dir(tmp_path):
    sweep = _start(
        tmp_path,
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.study_name=diag",
        "hydra.sweeper.baseline=false",
        "hydra.sweeper.max_failure_rate=1.0",
        "model.case=choice(segfault,valueerror)",
    )
    assert sweep.wait(timeout=120) == 0, (tmp_path / "sweep.log").read_text()[-3000:]
    by = {t.params["model.case"]: t.user_attrs for t in _trials(tmp_path, "diag")}
    seg, val = by["segfault"], by["valueerror"]
    assert seg["traceback"].startswith("Fatal Python error: Segmentation fault")
    assert "in fake_result" in seg["traceback"]  # the user's frame
    assert "ValueError: fake: bad shape" in val["traceback"] and "fake_result" in val["traceback"]
    for attrs in (seg, val):
        assert attrs["run_dir"] and Path(attrs["run_dir"]).is_dir()
        assert all(Path(p).is_file() for p in attrs["logs"])
