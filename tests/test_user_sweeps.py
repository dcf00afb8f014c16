"""A user's own multi-rank training swept by gpuopt, one job per trial, whatever starts its ranks:

- a Lightning script with `strategy="ddp", devices=2`: Lightning re-launches the script for rank
  1, which in a trial must run the trial's own config (gpuopt.sweeper.launchers.trial_task presents
  the trial as a single run of the script; its rank entry, relaunched_rank);
- a torchrun-style script, swept with `hydra.launcher.nproc_per_node=2`: the trial's task as two
  ranks started by torch's elastic launcher (gpuopt.processes.user_ranks);
- the Hugging Face Trainer (gpuopt.HFMeasureCallback), also with `nproc_per_node=2`;
- on SLURM, the ranks as the tasks of one job (trial_task.run_as_slurm_rank), and gpuopt's own
  trial over two "nodes" (two agents of one rendezvous on this machine).

Real parts: gloo at world size 2 on the 2 cores, real Lightning, the real transformers Trainer on a
small GPT-2 built from a config, the real single-node SLURM of tests/helpers/slurm.py. Each kind:
a sweep of its baseline (the trial ok, its world size and global batch right; the confirmation's
runs are trials of the same launcher, and one user app's confirmed sweep in all is the real
lightning-hydra-template's, tests/test_stock_apps.py), a failing rank (its own error is the trial's reason), a `kill -9` of the sweep (no process
of the trial left). Plus the pieces, unit by unit: the single run's command line, SLURM's
rendezvous, the rank files, the SIGKILL wording.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from gpuopt.core import rank_files
from gpuopt.core.rendezvous import first_host, rendezvous_port, slurm_endpoint, slurm_rank_env
from gpuopt.core.result import Status, TrialResult
from gpuopt.study.keys import STUDY_CONFIRMATION
from gpuopt.sweeper.launchers import oom_evidence, submitit_base, trial_task
from gpuopt.sweeper.launchers.results import describe_exit
from tests.helpers import slurm as slurm_helper
from tests.helpers.user_apps import write_app

ROOT = Path(__file__).resolve().parent.parent
ONE_TRIAL = [
    "hydra.sweeper.n_trials=1",
    "hydra.sweeper.baseline=false",
    "hydra.sweeper.confirm.rounds=0",
]
KINDS = ["lightning", "torchrun", "hf_trainer"]
# What one optimizer step trains on, per kind's baseline: micro-batch x accumulation x 2 ranks.
BASELINE_BATCH = {"lightning": (32, 1), "torchrun": (32, 1), "hf_trainer": (8, 2)}
needs_slurm = pytest.mark.skipif(
    slurm_helper.missing() is not None, reason=str(slurm_helper.missing())
)


def _needs(kind: str) -> None:
    if kind == "lightning":
        pytest.importorskip("lightning")
    if kind == "hf_trainer":
        pytest.importorskip("transformers")
        pytest.importorskip("accelerate")


def _env(folder: Path, **extra: str) -> dict[str, str]:
    # A mark every process of the sweep inherits: the kill test finds them all by it.
    return {**os.environ, "HYDRA_FULL_ERROR": "1", "GPUOPT_TEST_SWEEP": str(folder), **extra}


def _sweep(folder: Path, *args: str, env: dict[str, str], timeout: float = 500) -> str:
    done = subprocess.run(
        [sys.executable, "train.py", "-m", *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return f"exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


def _trials(folder: Path) -> tuple[optuna.Study, list[optuna.trial.FrozenTrial]]:
    study = optuna.load_study(study_name="mine", storage=f"sqlite:///{folder / 'gpuopt.db'}")
    return study, sorted(study.get_trials(), key=lambda t: t.number)


def _marked(folder: Path) -> list[int]:
    """Live processes (not zombies) that inherited the sweep's mark."""
    mark = f"GPUOPT_TEST_SWEEP={folder}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in "ZX":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


# ---- each kind swept: its baseline (world size, global batch), then a trial whose rank fails ------
BASELINE_ONLY = ["hydra.sweeper.n_trials=1", "hydra.sweeper.confirm.rounds=0"]
# The searched batch size the second trial runs (the baseline's is the other choice).
OTHER_BATCH = {"lightning": "64", "torchrun": "64", "hf_trainer": "16"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_sweeps_its_baseline_and_a_failing_rank_is_the_next_trials_reason(tmp_path, kind):
    """One sweep per kind: the baseline measured as the job it is; the next trial's rank 1 fails
    ($FAIL_BATCH: only at the other batch size), and its own error is that trial's reason."""
    _needs(kind)
    write_app(tmp_path, kind)
    env = _env(tmp_path, FAIL_RANK="1", FAIL_BATCH=OTHER_BATCH[kind])
    log = _sweep(tmp_path, "hydra.sweeper.n_trials=2", "hydra.sweeper.confirm.rounds=0", env=env)
    study, trials = _trials(tmp_path)
    baseline, other = [t for t in trials if t.user_attrs.get("status") != "void"]
    attrs = baseline.user_attrs
    assert attrs["status"] == "ok" and attrs["world_size"] == 2, attrs.get("reason")
    assert attrs["baseline"] is True and baseline.state is TrialState.COMPLETE, log
    micro, accumulation = attrs["micro_batch"], attrs["accumulation_steps"]
    assert (micro, accumulation) == BASELINE_BATCH[kind]
    assert attrs["global_batch"] == micro * accumulation * 2  # x the world size
    assert [row["rank"] for row in attrs["ranks"]] == [0, 1]
    assert len({row["timed_steps"] for row in attrs["ranks"]}) == 1  # aligned windows
    assert other.user_attrs["status"] == "error", log
    reason = other.user_attrs["reason"]
    assert reason.startswith("rank 1: RuntimeError: rank 1 broke on purpose"), reason
    assert "OOM killer" not in reason
    assert STUDY_CONFIRMATION not in study.user_attrs
    assert not _marked(tmp_path), "a rank outlived its trial"


@pytest.mark.slow
def test_measure_job_measures_every_rank_of_a_plain_loop_under_nproc_per_node(tmp_path):
    """gpuopt.MeasureJob in the app's YAML alone, its ranks started by gpuopt: the trial is the
    job (its world size, both ranks' rows, aligned windows), and no rank outlives it."""
    write_app(tmp_path, "plain_ddp")
    log = _sweep(tmp_path, *BASELINE_ONLY, env=_env(tmp_path))
    assert log.startswith("exit 0"), log
    _, trials = _trials(tmp_path)
    (trial,) = [t for t in trials if t.user_attrs.get("status") != "void"]
    attrs = trial.user_attrs
    assert attrs["status"] == "ok" and attrs["world_size"] == 2, attrs.get("reason")
    assert attrs["config"]["engine"]["name"] == "measure_job"
    assert (attrs["micro_batch"], attrs["global_batch"]) == (32, 64)  # x the world size
    assert [row["rank"] for row in attrs["ranks"]] == [0, 1]
    assert len({row["timed_steps"] for row in attrs["ranks"]}) == 1  # aligned windows
    assert not _marked(tmp_path), "a rank outlived its trial"


# ---- kill -9 of the sweep: no rank left behind --------------------------------------------------------
# gpuopt starts every kind's ranks alike (gpuopt.processes.user_ranks): Lightning's, the one kind
# whose framework could start processes of its own, stands for all.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lightning"])
def test_a_killed_sweep_leaves_no_rank_of_its_trial_behind(tmp_path, kind):
    _needs(kind)
    write_app(tmp_path, kind)
    sweep = subprocess.Popen(
        [sys.executable, "train.py", "-m", *ONE_TRIAL],
        cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list(tmp_path.glob("multirun/*/*/0/pids/*"))) < 2:
            time.sleep(0.2)  # both ranks started (each notes its pid)
        assert len(list(tmp_path.glob("multirun/*/*/0/pids/*"))) == 2, "the ranks never started"
        assert len(_marked(tmp_path)) > 2  # the sweep, the trial, its ranks
        sweep.send_signal(signal.SIGKILL)
        sweep.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _marked(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _marked(tmp_path), "processes of the killed sweep's trial still run"
    finally:
        for pid in _marked(tmp_path):
            os.kill(pid, signal.SIGKILL)


# ---- on SLURM: the ranks are the tasks of one job -------------------------------------------------------
SLURM_JOB = [
    "hydra/launcher=slurm",
    "hydra.launcher.nproc_per_node=2",
    "hydra.launcher.gpus_per_task=null",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.poll_s=1",
    "hydra.launcher.timeout_min=5",
]


@pytest.fixture(scope="module")
def cluster():
    with slurm_helper.slurm_cluster() as running:
        yield running


@pytest.mark.slow
@needs_slurm
def test_on_slurm_a_multi_rank_job_is_two_tasks_of_one_job_and_its_failing_rank_the_reason(
    tmp_path, cluster
):
    """A torchrun-style loop with gpuopt.MeasureJob in its YAML alone, its two ranks the SLURM
    tasks of one job (each a Hydra job of its own, its callback measuring its loop): the trial is
    the job. Then a failing rank of the next trial: its own error, SLURM ending the job's other
    task. (A script calling gpuopt.measure_step starts its ranks the same way:
    trial_task.run_as_slurm_rank.)"""
    write_app(tmp_path, "plain_ddp")
    env = {**_env(tmp_path), **cluster.env}
    log = _sweep(tmp_path, *SLURM_JOB, *BASELINE_ONLY, env=env)
    assert log.startswith("exit 0"), log + cluster.logs()
    _, (trial,) = _trials(tmp_path)
    attrs = trial.user_attrs
    assert attrs["status"] == "ok" and attrs["world_size"] == 2, attrs.get("reason")
    assert attrs["config"]["engine"]["name"] == "measure_job" and attrs["global_batch"] == 64
    assert [row["rank"] for row in attrs["ranks"]] == [0, 1]
    (script,) = tmp_path.glob("multirun/*/*/.submitit/*/*_submission.sh")
    text = script.read_text()
    assert "--ntasks-per-node=2" in text and "--kill-on-bad-exit=1" in text
    log = _sweep(tmp_path, *SLURM_JOB, "hydra.sweeper.n_trials=2", env={**env, "FAIL_RANK": "1"})
    _, trials = _trials(tmp_path)
    assert trials[-1].user_attrs["reason"].startswith("rank 1: RuntimeError: rank 1 broke"), log


@pytest.mark.slow
def test_gpuopts_own_trial_over_two_nodes_meets_at_the_rendezvous_and_reports_the_job(tmp_path):
    """`distributed.nnodes=2`: two agents (one per "node", here both on this machine, as two tasks
    of a SLURM job would be) of one rendezvous; each node's trial merges every rank's result from
    the shared run directory."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [
        sys.executable, "-m", "gpuopt.run", "distributed=ddp", "distributed.nproc_per_node=1",
        "distributed.nnodes=2", f"distributed.rdzv_endpoint=127.0.0.1:{port}", "device=cpu",
        "device.num_threads=1", "model=mlp", "model.width=32", "model.depth=1", "data.size=256",
        "measure=quick", "measure.count_flops=false", "measure.ceiling=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(
            args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=200)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    result = TrialResult.load(tmp_path / "run" / "result.json")
    assert result.status is Status.OK and result.metrics.world_size == 2, result.reason
    assert [row["rank"] for row in result.ranks or []] == [0, 1]


# ---- the pieces ---------------------------------------------------------------------------------------
def test_a_trial_presents_itself_as_a_single_run_of_the_script(monkeypatch):
    """What a re-launched rank gets on its command line: the config options of the sweep's command
    line, the trial's task overrides, and none of the sweep's own settings."""
    argv = ["-m", "--config-dir", "/x/conf", "--config-name=exp", "-cp", "y", "lr=0.1"]
    assert trial_task.config_arguments(argv) == (
        "--config-dir",
        "/x/conf",
        "--config-name=exp",
        "-cp",
        "y",
    )
    hydra = SimpleNamespace(
        overrides=SimpleNamespace(
            task=["batch_size=64", "+extra=1"],
            hydra=["hydra.mode=MULTIRUN", "hydra.sweeper.n_trials=2", "hydra/launcher=fresh_process",
                   "hydra.launcher.nproc_per_node=2", "hydra.run.dir=x", "hydra.job.chdir=true"],
        )
    )  # fmt: skip
    assert trial_task.run_overrides(hydra) == ["batch_size=64", "+extra=1", "hydra.job.chdir=true"]
    monkeypatch.setattr(sys, "argv", ["/app/train.py", "-cn", "exp", "lr=0.1"])
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__file__="/app/train.py"))
    assert trial_task.entry_args() == ("--gpuopt-script", "/app/train.py", "--", "-cn", "exp")


def test_slurm_tasks_are_ranks_meeting_on_the_jobs_first_node():
    env = {
        "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "123_4", "SLURM_JOB_NODELIST": "gpu[07-08]",
    }  # fmt: skip
    ranks = slurm_rank_env(env)
    assert {k: ranks[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1",
    }  # fmt: skip
    assert ranks["MASTER_ADDR"] == "gpu07" and ranks["MASTER_PORT"] == str(rendezvous_port("1234"))
    assert 20000 <= rendezvous_port("1234") < 30000 and rendezvous_port("7") != rendezvous_port("8")
    assert slurm_rank_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == {}  # one task: no ranks
    assert slurm_endpoint({}) is None
    assert slurm_endpoint({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1"}) == "n1:20005"


def test_first_host_reads_slurms_node_lists_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the list as SLURM writes it
    assert first_host("node[003-005,9],gpu7") == "node003"
    assert first_host("gpu7,node[1-2]") == "gpu7"
    assert first_host("solo") == "solo"


def test_the_rank_that_failed_first_is_the_trials_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(rank_files.RANKS_DIR_ENV, str(tmp_path))
    later = TrialResult(Status.ERROR, reason="RuntimeError: Connection closed by peer")
    later.env["failed_at"] = 200.0
    first = TrialResult(Status.OOM, reason="CUDA out of memory")
    first.env["failed_at"] = 100.0
    rank_files.write_rank_result(later, 0)
    rank_files.write_rank_result(first, 1)
    rank_files.write_rank_result(TrialResult(Status.OK), 2)
    found = rank_files.first_failure(tmp_path)
    assert found is not None and (found.rank, found.status) == (1, Status.OOM)
    assert found.text == "rank 1: CUDA out of memory"
    rank_files.clear(tmp_path)
    assert rank_files.first_failure(tmp_path) is None


def test_a_trial_killed_after_its_rank_failed_reports_the_rank_first(tmp_path):
    """Lightning's launcher SIGKILLs the trial once rank 1 exited: the trial's result is rank 1's
    own failure (its status too), then how the trial process ended."""
    ranks = tmp_path / rank_files.RANKS_FOLDER
    ranks.mkdir()
    failed = TrialResult(
        Status.OOM, reason="RuntimeError: out of memory", env={"rank": 1, "failed_at": 1.0}
    )
    (ranks / "rank_1.json").write_text(json.dumps(failed.to_dict()))
    job = SimpleNamespace(paths=SimpleNamespace(stderr=tmp_path / "none.err"))
    ret = submitit_base.resultless(job, ["x=1"], describe_exit(-9), str(tmp_path))
    result = ret.return_value
    assert isinstance(result, TrialResult) and result.status is Status.OOM
    assert result.reason == (
        "rank 1: RuntimeError: out of memory (then the trial process: killed by signal SIGKILL)"
    )
    plain = submitit_base.resultless(job, ["x=1"], describe_exit(-9), str(tmp_path / "other"))
    with pytest.raises(RuntimeError, match=r"^killed by signal SIGKILL$"):
        plain.return_value  # noqa: B018


def test_sigkill_is_the_oom_killers_only_with_evidence(tmp_path, monkeypatch):
    assert describe_exit(-9) == "killed by signal SIGKILL"
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    monkeypatch.setattr(oom_evidence, "_cgroup_files", lambda root=None: [events])
    monkeypatch.setattr(oom_evidence, "_kernel_log", lambda: [])
    watch = oom_evidence.OomWatch.start()
    assert watch.evidence([123]) is None  # nothing new
    events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    evidence = watch.evidence([123])
    assert evidence == f"{events} oom_kill 1 -> 2"
    assert describe_exit(-9, evidence) == (
        f"killed by signal SIGKILL by the kernel's OOM killer ({events} oom_kill 1 -> 2)"
    )
    line = "[ 12.3] Out of memory: Killed process 4242 (python) total-vm:1kB"
    monkeypatch.setattr(oom_evidence, "_kernel_log", lambda: [line])
    quiet = oom_evidence.OomWatch(None, None)
    assert quiet.evidence([4242]) == f"the kernel log: {line}"
    assert quiet.evidence([4243]) is None  # another process's OOM kill is not this trial's


@pytest.mark.parametrize(
    ("setting", "allowed"),
    [
        ("hydra.launcher.nproc_per_node=0", "an integer >= 1"),
        ("hydra.launcher.rdzv_timeout_s=0", "seconds > 0"),
        ("hydra.launcher.timeout_s=-1", "seconds > 0"),
        (  # gpuopt's own app starts its ranks itself
            "hydra.launcher.nproc_per_node=2",
            "1 for gpuopt's own app (distributed=ddp distributed.nproc_per_node=N starts ranks)",
        ),
    ],
)
def test_a_bad_launcher_setting_is_one_line_before_anything_is_created(
    tmp_path, cli_forks, setting, allowed
):
    # `python -m gpuopt.run -m ...` in a process of its own (forked: tests/helpers/forked_cli.py)
    done = cli_forks.run(
        "gpuopt.run", ["-m", "hydra/launcher=fresh_process", setting], tmp_path,
        {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path / "outputs")},
    )  # fmt: skip
    key, value = setting.split("=")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"gpuopt: invalid config: {key}={float(value) if 'timeout' in key else int(value)!r}; allowed: {allowed}"
    ]
    assert list(tmp_path.iterdir()) == []


def test_gpuopts_trial_over_several_nodes_is_one_slurm_task_per_node():
    from omegaconf import OmegaConf

    from gpuopt.sweeper.launchers.slurm import KILL_ON_BAD_EXIT, trial_resources

    cfg = OmegaConf.create({"distributed": {"kind": "ddp", "nproc_per_node": 4, "nnodes": 2}})
    extra = trial_resources(cfg, {"gpus_per_task": 1, "cpus_per_task": 8})
    assert extra == {
        "tasks_per_node": 1, "nodes": 2, "gpus_per_task": 4, "srun_args": (KILL_ON_BAD_EXIT,),
    }  # fmt: skip


def test_a_relaunched_rank_runs_the_script_as_its_own_and_writes_its_failure(tmp_path):
    """The entry Lightning re-launches a trial's rank 1 through: the script's own folder first on
    sys.path (a user's `gpus.py` is the user's, not gpuopt's launcher module of that name), the
    trial's overrides as its arguments, its output in ranks/, and its startup failure written as
    the rank's own (the trial's reason: `rank 1: ModuleNotFoundError: ...`)."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "gpus.py").write_text('VALUE = "mine"\n')
    (app / "train.py").write_text(
        "import sys, gpus\nprint(gpus.VALUE, sys.argv[1:])\nimport a_module_that_is_not_installed\n"
    )
    ranks = tmp_path / "ranks"
    env = {
        **os.environ, "LOCAL_RANK": "1", rank_files.RANKS_DIR_ENV: str(ranks),
        rank_files.TRIAL_PID_ENV: str(os.getpid()),
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, trial_task.RELAUNCH_ENTRY, "--gpuopt-script", str(app / "train.py"),
         "--", "batch_size=64", 'hydra.run.dir="x"'],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        ranks / "rank_1.stdout.log"
    ).read_text() == "mine ['batch_size=64', 'hydra.run.dir=\"x\"']\n"
    assert "No module named" in (ranks / "rank_1.stderr.log").read_text()
    failure = rank_files.first_failure(ranks)
    assert failure is not None and failure.rank == 1
    assert (
        failure.text
        == "rank 1: ModuleNotFoundError: No module named 'a_module_that_is_not_installed'"
    )


def test_on_slurm_rank_0_broken_by_a_peers_failure_reports_the_peers_own_error(
    tmp_path, monkeypatch
):
    """Rank 0's collective breaks because rank 1 failed and ended ("Connection closed by peer"):
    the trial's reason is rank 1's own error, read from the rank file it wrote before it ended;
    with no peer's failure on record rank 0's own exception stands."""
    from gpuopt.core import rank_files
    from gpuopt.core.result import Status, TrialResult

    monkeypatch.setenv(rank_files.RANKS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setattr(trial_task, "PEER_FAILURE_WAIT_S", 0.2)

    def broken() -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        trial_task.run_as_slurm_rank(broken, tmp_path)
    rank_files.write_rank_result(TrialResult(Status.ERROR, reason="ValueError: a bug"), rank=1)
    result = trial_task.run_as_slurm_rank(broken, tmp_path)
    assert result.status is Status.ERROR and result.reason == "rank 1: ValueError: a bug"
