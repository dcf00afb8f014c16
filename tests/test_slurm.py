"""hydra/launcher=slurm against a real single-node SLURM cluster (tests/helpers/slurm.py).

Unit tests for how a job's end is read and worded; end-to-end sweeps submit their trials with
sbatch (hydra-submitit-launcher's SLURM mode, gpuopt.sweeper.launchers.slurm) to slurmctld and
slurmd running on this host, and check that they complete, and that a trial SLURM kills at its time
limit is an `error` with SLURM's verdict while the sweep goes on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from gpuopt.sweeper.launchers.slurm import SlurmJobState, end_reason, parse_squeue, state_from_log
from tests.helpers import slurm as slurm_helper

HELPERS = Path(__file__).parent / "sweep_helpers"
# One CPU, 1 GB, no GPU per trial job; squeue every second.
SLURM_JOB = [
    "hydra/launcher=slurm",
    "hydra.launcher.gpus_per_task=null",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.poll_s=1",
]
FAST = ["~search", "measure=quick", "hydra.sweeper.device_aware=false"]
needs_slurm = pytest.mark.skipif(
    slurm_helper.missing() is not None, reason=str(slurm_helper.missing())
)


# ---- how a job's end is read -----------------------------------------------------------------------


def test_parse_squeue_reads_array_tasks_and_reasons():
    text = "12_0|COMPLETED|None\n12_1|TIMEOUT|TimeLimit\n13|PENDING|Resources\n\n"
    states = parse_squeue(text)
    assert states["12_1"] == SlurmJobState("12_1", "TIMEOUT", "TimeLimit")
    assert states["12_1"].ended and states["12_0"].ended and not states["13"].ended
    assert set(states) == {"12_0", "12_1", "13"}


@pytest.mark.parametrize(
    ("line", "state"),
    [
        ("slurmstepd-vm: error: *** JOB 2 ON vm CANCELLED AT 2026-12-01T08:39:03 DUE TO TIME LIMIT ***", "TIMEOUT"),
        ("slurmstepd: error: *** STEP 7.0 ON n1 CANCELLED AT 2026-12-01T08:39:03 DUE TO TIME LIMIT ***", "TIMEOUT"),
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-12-01T08:39:03 DUE TO PREEMPTION ***", "PREEMPTED"),
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-12-01T08:39:03 ***", "CANCELLED"),
    ],
)  # fmt: skip
def test_state_from_slurmstepd_line(line, state):
    found = state_from_log("2", f"some output\n{line}\nmore\n")
    assert found is not None and found.state == state and found.ended


def test_state_from_log_without_a_slurm_line_is_none():
    assert state_from_log("2", "Traceback (most recent call last):\nValueError: x\n") is None


@pytest.mark.parametrize(
    ("state", "exit_code", "reason"),
    [
        ("TIMEOUT", None, "cancelled by SLURM: TIME LIMIT (hydra.launcher.timeout_min=3), job 5_1"),
        (
            "OUT_OF_MEMORY",
            None,
            "killed by SLURM: OUT OF MEMORY (hydra.launcher.mem_gb=2), job 5_1",
        ),
        ("CANCELLED by 0", None, "cancelled by SLURM (scancel or an administrator), job 5_1"),
        ("FAILED", -9, "SLURM job 5_1 ended FAILED: killed by signal SIGKILL"),
        ("FAILED", 3, "SLURM job 5_1 ended FAILED: exited with code 3 without a result"),
        (
            "FAILED|purged",
            None,
            "SLURM job 5_1 ended FAILED (purged): ended without an exit status",
        ),
    ],
)
def test_end_reason_names_slurms_verdict_and_the_knob(state, exit_code, reason):
    name, _, why = state.partition("|")
    job = SlurmJobState("5_1", name, why)
    text = end_reason(job, {"timeout_min": 3, "mem_gb": 2}, exit_code)
    assert text.startswith(reason)


# ---- a real cluster --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm_helper.SlurmCluster]:
    with slurm_helper.slurm_cluster() as running:
        yield running


def sweep(
    tmp_path: Path, cluster: slurm_helper.SlurmCluster, *args: str, app: list[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **cluster.env, "GPUOPT_OUTPUT_DIR": str(tmp_path), "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [sys.executable, *app, "-m", *SLURM_JOB, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + cluster.logs()
    return proc


def squeue_states(cluster: slurm_helper.SlurmCluster) -> dict[str, SlurmJobState]:
    out = subprocess.run(
        ["squeue", "--states=all", "-h", "-r", "-o", "%i|%T|%r"],
        env={**os.environ, **cluster.env},
        capture_output=True,
        text=True,
        check=True,
    )
    return parse_squeue(out.stdout)


def settled_states(
    cluster: slurm_helper.SlurmCluster, timeout_s: float = 30.0
) -> dict[str, SlurmJobState]:
    """squeue's states once no job is RUNNING or COMPLETING any more, or as they are at the
    timeout: a job whose result the sweep has read still runs until its process exits (a
    distributed trial's ranks first), then slurmd cleans up after its last step (transient, seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = squeue_states(cluster)
        busy = any(s.state in ("RUNNING", "COMPLETING") for s in states.values())
        if time.monotonic() > deadline or not busy:
            return states
        time.sleep(0.5)


def trials_of(tmp_path: Path, study: str) -> list[optuna.trial.FrozenTrial]:
    storage = f"sqlite:///{tmp_path / 'gpuopt.db'}"
    return optuna.load_study(study_name=study, storage=storage).get_trials()


@pytest.mark.slow
@needs_slurm
def test_sweep_runs_its_trials_as_slurm_jobs_to_completion(tmp_path, cluster):
    """The real engine (tiny), 3 trials in batches of 2: each batch one sbatch job array."""
    before = set(squeue_states(cluster))
    proc = sweep(
        tmp_path,
        cluster,
        *FAST,
        "measure.time_budget_s=0.3",
        "measure.count_flops=false",
        "measure.ceiling=false",
        "model.depth=1",
        "data.size=256",
        "hydra.sweeper.confirm.rounds=0",
        "hydra.sweeper.profile=false",  # the trials' jobs only (no profiled run of the best)
        "hydra.sweeper.study_name=s",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=2",
        "hydra.launcher.timeout_min=5",
        "loader.batch_size=choice(16,64)",
        app=["-m", "gpuopt.run"],
        timeout=150,
    )
    trials = trials_of(tmp_path, "s")
    assert len(trials) == 3
    assert all(t.state == TrialState.COMPLETE and t.user_attrs["status"] == "ok" for t in trials)
    assert "gpuopt sweep summary" in proc.stdout
    # They ran as SLURM jobs: slurmctld lists them COMPLETED (two arrays: 2 + 1 tasks), and each
    # trial's submitit log shows its SLURM job environment.
    jobs = {k: v for k, v in settled_states(cluster).items() if k not in before}
    assert len(jobs) == 3 and {s.state for s in jobs.values()} == {"COMPLETED"}
    assert len({k.split("_")[0] for k in jobs}) == 2
    logs = {p.parent.name: p.read_text() for p in tmp_path.glob("sweeps/*/*/.submitit/*/*_log.out")}
    assert set(logs) == set(jobs)
    assert all(f"Starting with JobEnvironment(job_id={k}," in text for k, text in logs.items())


def _running(cluster: slurm_helper.SlurmCluster) -> set[str]:
    return {job for job, state in squeue_states(cluster).items() if state.state == "RUNNING"}


def _warned(tmp_path: Path, job_id: str) -> bool:
    """gpuopt's USR2 line is in the job's stderr (the trial went on after SLURM's warning)."""
    return any(
        "gpuopt: SLURM sent SIGUSR2" in path.read_text(errors="replace")
        for path in tmp_path.glob(f"sweeps/*/*/.submitit/{job_id}/{job_id}_0_log.err")
    )


def _scontrol(cluster: slurm_helper.SlurmCluster, *args: str) -> None:
    env = {**os.environ, **cluster.env}
    subprocess.run(list(args), env=env, capture_output=True, text=True, check=True)


@pytest.mark.slow
@needs_slurm
def test_trial_killed_at_slurms_time_limit_is_an_error_and_the_sweep_goes_on(tmp_path, cluster):
    """Trial #1 hangs. Once its task runs (its pid noted), SLURM's time-limit warning is sent to
    it as slurmctld sends it (`scancel --signal=USR2`: submitit's signal) and it runs on; then its
    end time is moved to now (`scontrol update EndTime=`, as an administrator shortens a limit)
    and slurmctld's next time-limit check (every 30 s) kills it with the TIMEOUT of a job that
    reached its limit; trial #2 still runs. timeout_min=5 leaves SLURM's own warning and limit
    out of the test's way. The grid's seed puts the hanging point first."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, **cluster.env, "GPUOPT_OUTPUT_DIR": str(tmp_path), "HYDRA_FULL_ERROR": "1"}
    cmd = [
        str(HELPERS / "fake_task.py"), "-m", *SLURM_JOB, *FAST,
        "hydra.sweeper.confirm.rounds=0",
        "hydra.sweeper.profile=false",  # no profiled run of the best at the end
        "hydra.sweeper.study_name=t",
        "hydra.sweeper.max_failure_rate=0.9",
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.sampler.seed=0",
        "hydra.launcher.timeout_min=5",
        f"model.pid_dir={pids}",
        "model.case=choice(hang,fine)",
    ]  # fmt: skip
    out = tmp_path / "sweep.out"
    with out.open("w") as stdout:
        proc = subprocess.Popen(
            [sys.executable, *cmd], cwd=tmp_path, env=env, stdout=stdout, stderr=subprocess.STDOUT
        )
    hanging: str | None = None  # the hanging trial's job, once its task runs
    ended: dict[str, datetime] = {}  # job -> when its end time was moved to now
    try:
        deadline = time.monotonic() + 170
        while proc.poll() is None and time.monotonic() < deadline:
            if hanging is None and len(list(pids.iterdir())) == 2 and _running(cluster):
                # the baseline's task and the hanging one's ran: the job running is #1's
                (hanging,) = _running(cluster)
                _scontrol(cluster, "scancel", "--signal=USR2", hanging)
            elif hanging and hanging not in ended and _warned(tmp_path, hanging):
                ended[hanging] = datetime.now().replace(microsecond=0)
                _scontrol(cluster, "scontrol", "update", f"JobId={hanging}", "EndTime=now+1")
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = out.read_text()
    assert proc.returncode == 0, text[-3000:] + cluster.logs()
    trials = trials_of(tmp_path, "t")
    assert [t.params.get("model.case") for t in trials] == [None, "hang", "fine"]
    baseline, hung, after = trials
    assert baseline.user_attrs["status"] == "ok" and after.user_attrs["status"] == "ok"
    assert hung.state == TrialState.FAIL and hung.user_attrs["status"] == "error"
    reason = hung.user_attrs["reason"]
    assert reason.startswith("cancelled by SLURM: TIME LIMIT (hydra.launcher.timeout_min=5), job ")
    # The job's stderr, slurmstepd's verdict included, is kept with the trial.
    verdict = re.search(r"CANCELLED AT (\S+) DUE TO TIME LIMIT", hung.user_attrs["traceback"])
    assert verdict, hung.user_attrs["traceback"][-2000:]
    job_id = reason.rsplit("job ", 1)[1]
    assert settled_states(cluster)[job_id].state == "TIMEOUT"
    # The warning did not end or requeue it: it ran on after it, until its end time.
    assert job_id in ended and _warned(tmp_path, job_id), (ended, text[-3000:])
    assert datetime.fromisoformat(verdict.group(1)) >= ended[job_id]
    assert "gpuopt sweep summary" in text


@pytest.mark.slow
@needs_slurm
def test_terminated_sweep_cancels_its_running_trial_jobs(tmp_path, cluster):
    """SIGTERM (a scheduler's stop, `kill`) of the sweep: its trial job does not run on."""
    env = {**os.environ, **cluster.env, "GPUOPT_OUTPUT_DIR": str(tmp_path)}
    before = set(squeue_states(cluster))
    cmd = [sys.executable, str(HELPERS / "fake_task.py"), "-m", *SLURM_JOB, *FAST]
    cmd += ["hydra.sweeper.confirm.rounds=0", "hydra.launcher.timeout_min=5", "model.case=hang"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        running: list[str] = []
        while not running and time.monotonic() < deadline:
            time.sleep(0.5)
            states = squeue_states(cluster).items()
            running = [k for k, v in states if k not in before and v.state == "RUNNING"]
        assert running, "the trial job never started"
        proc.terminate()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 15
    while squeue_states(cluster)[running[0]].state != "CANCELLED" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert squeue_states(cluster)[running[0]].state == "CANCELLED"


# ---- a distributed trial: one job, one task, its ranks started by the trial ----------------------


@pytest.mark.parametrize(
    ("overrides", "params", "extra"),
    [
        ({}, {"gpus_per_task": 1, "cpus_per_task": 8}, {}),
        ({"kind": "ddp", "nproc_per_node": 4}, {"gpus_per_task": 1, "cpus_per_task": 8},
         {"tasks_per_node": 1, "gpus_per_task": 4}),
        ({"kind": "fsdp2", "nproc_per_node": 2}, {"gpus_per_task": None, "cpus_per_task": 1},
         {"tasks_per_node": 1, "cpus_per_task": 2}),
        ({"kind": "ddp", "nproc_per_node": 8}, {"gpus_per_node": 1, "cpus_per_task": 16},
         {"tasks_per_node": 1, "gpus_per_node": 8}),
    ],
)  # fmt: skip
def test_a_distributed_trial_asks_for_one_task_with_a_gpu_per_rank(overrides, params, extra):
    from omegaconf import OmegaConf

    from gpuopt.sweeper.launchers.slurm import trial_resources

    cfg = OmegaConf.create({"distributed": {"kind": "none", **overrides}})
    assert trial_resources(cfg, params) == extra


@pytest.mark.slow
@needs_slurm
def test_a_distributed_trial_is_one_slurm_job_whose_trial_starts_its_ranks(tmp_path, cluster):
    """DDP over 2 gloo ranks: one sbatch job of one task (2 CPUs), one trial with both ranks."""
    before = set(squeue_states(cluster))
    sweep(
        tmp_path,
        cluster,
        *FAST,
        "distributed=ddp",
        "distributed.nproc_per_node=2",
        "device=cpu",
        "device.num_threads=1",
        "model.width=32",
        "model.depth=1",
        "data.size=256",
        "measure.time_budget_s=0.3",
        "measure.count_flops=false",
        "measure.ceiling=false",
        "hydra.sweeper.confirm.rounds=0",
        "hydra.sweeper.profile=false",
        "hydra.sweeper.study_name=d",
        "hydra.sweeper.n_trials=1",
        "hydra.launcher.timeout_min=5",
        "hydra.launcher.mem_gb=2",
        app=["-m", "gpuopt.run"],
        timeout=150,
    )
    (trial,) = trials_of(tmp_path, "d")
    attrs = trial.user_attrs
    assert attrs["status"] == "ok", attrs.get("reason")
    assert attrs["world_size"] == 2 and [row["rank"] for row in attrs["ranks"]] == [0, 1]
    jobs = {k: v for k, v in settled_states(cluster).items() if k not in before}
    assert len(jobs) == 1 and {s.state for s in jobs.values()} == {"COMPLETED"}
    (script,) = tmp_path.glob("sweeps/*/*/.submitit/*/*_submission.sh")
    text = script.read_text()
    assert "--ntasks-per-node=1" in text and "--cpus-per-task=2" in text
