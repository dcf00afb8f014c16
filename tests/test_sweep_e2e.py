"""End-to-end sweeps: real Hydra multirun, real Optuna SQLite storage, as subprocesses.

`python -m gpuopt.run -m` runs the real trial engine at tiny sizes (measure=quick, a 16-wide MLP).
tests/sweep_helpers/fake_task.py is the same config tree with a deterministic stand-in engine, for
the statuses a real CPU cannot produce on demand (diverged, a crash, a dying process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from gpuopt.core import knobs
from gpuopt.core.result import Metrics
from gpuopt.study.keys import (
    ATTR_BASELINE,
    STUDY_CONFIRMATION,
    STUDY_DIRECTIONS,
    STUDY_HARDWARE,
    STUDY_OBJECTIVES,
)

pytestmark = pytest.mark.slow

HELPERS = Path(__file__).parent / "sweep_helpers"
# The real engine, as small and short as it goes: trials of ~1-2 s in-process.
TINY = [
    "~search",
    "measure=quick",
    "measure.time_budget_s=0.3",
    "measure.count_flops=false",
    "measure.ceiling=false",
    "model.depth=1",
    "data.size=256",
    "hydra.sweeper.device_aware=false",
]
IN_PROCESS = ["hydra/launcher=basic"]


def sweep(
    tmp_path: Path,
    *args: str,
    app: list[str] | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *(app or ["-m", "gpuopt.run"]), "-m", *args]
    full_env = {
        **os.environ,
        "GPUOPT_OUTPUT_DIR": str(tmp_path),
        "HYDRA_FULL_ERROR": "1",
        **(env or {}),
    }
    return subprocess.run(
        cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def fake(tmp_path: Path, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return sweep(tmp_path, *args, app=[str(HELPERS / "fake_task.py")], **kw)


def load(tmp_path: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'gpuopt.db'}")


def sweep_dir(tmp_path: Path, pattern: str = "sweeps/*/*") -> Path:
    dirs = sorted(tmp_path.glob(pattern))
    assert len(dirs) == 1, dirs
    return dirs[0]


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


# ---- the real engine ------------------------------------------------------------------------------


def test_sweep_writes_study_baseline_confirmation_and_best_config(tmp_path):
    proc = ok(
        sweep(
            tmp_path,
            *TINY,
            *IN_PROCESS,
            "model.width=16",
            "hydra.sweeper.n_trials=4",
            "loader.batch_size=choice(8,32)",
            "loader.num_workers=choice(0,1)",
            "hydra.sweeper.confirm.top_k=1",
            "hydra.sweeper.confirm.rounds=2",
            "hydra.sweeper.confirm.max_share=1.0",
            "hydra.sweeper.confirm.window_s=0.2",
        )
    )
    from gpuopt.sweeper import machine as hardware

    summaries = optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'gpuopt.db'}")
    assert len(summaries) == 1
    name = summaries[0].study_name
    hw_id = hardware.hardware_id(hardware.hardware_facts())
    # workload, a digest of the search space (no search preset: ~search), hardware
    from gpuopt.sweeper.open_study import space_digest

    assert name == f"mlp-{space_digest(load(tmp_path, name).trials[-1].distributions)}-{hw_id}"
    assert "reproduce: python -m gpuopt.run --config-dir" in proc.stdout
    study = load(tmp_path, name)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 4  # no repeat: the space once

    baseline = trials[0]
    assert baseline.user_attrs[ATTR_BASELINE] is True
    assert baseline.params == {
        "loader.batch_size": 32,
        "loader.num_workers": 0,
    }  # the config as composed
    assert not any(t.user_attrs.get(ATTR_BASELINE) for t in trials[1:])
    for t in trials:
        attrs = t.user_attrs
        assert attrs["status"] == "ok" and t.system_attrs["constraints"] == [0.0, 0.0, 0.0]
        assert set(vars(Metrics())) <= set(attrs)  # every metric, flat
        assert t.values == [attrs["throughput_amortized"], attrs["utilization"]]
        assert 0 < attrs["throughput_amortized"] <= attrs["throughput"]
        # the resolved config the trial really ran is the one its params asked for
        assert attrs["config"]["loader"]["batch_size"] == t.params["loader.batch_size"]
        assert attrs["config"]["loader"]["num_workers"] == t.params["loader.num_workers"]
        assert f"loader.batch_size={t.params['loader.batch_size']}" in attrs["overrides"]
        assert (Path(attrs["run_dir"]) / "result.json").is_file()
        assert attrs["env"] and t.system_attrs["gpuopt:owner"]["pid"] > 0

    user = study.user_attrs
    assert user[STUDY_OBJECTIVES] == ["throughput_amortized", "utilization"]
    assert user[STUDY_DIRECTIONS] == ["maximize", "maximize"]
    assert user[STUDY_HARDWARE]["id"] == hw_id
    conf = user[STUDY_CONFIRMATION]
    # top_k=1, plus the best same-training candidate when it is not the best (both answers get
    # their confirmation; in one process the fresh-process cap does not drop it)
    labels = [c["label"] for c in conf["configs"]]
    assert labels in (["baseline", "candidate1"], ["baseline", "candidate1", "candidate2"])
    assert len(labels) == 2 or conf["configs"][2]["same_training"]
    # loader settings only: both share one process, measured in alternating windows; as many as
    # the fresh-process cap's time buys (4 runs of a ~1 s trial), at least confirm.rounds
    assert conf["mode"] == "in-process windows" and conf["window_s"] == 0.2
    # the baseline is in every round; a candidate leaves once it has its pairs (Stein's count for
    # it), so with two candidates the one that needs fewer has fewer values than the rounds
    n, first = conf["rounds"], conf["first_stage"]
    base, *cands = conf["configs"]
    assert n >= first >= 2 and len(base["confirm_values"]) == n
    assert max(len(c["confirm_values"]) for c in cands) == n
    for c in conf["configs"]:
        count = len(c["confirm_values"])
        assert first <= count <= n and c["confirm_statuses"] == ["ok"] * count
        assert c["confirm_rounds"] == list(range(count))
    comparison = conf["comparisons"][0]  # from the re-measurements only
    pairs = len(cands[0]["confirm_values"])
    assert comparison["ratio"] > 0
    assert comparison["n_pairs"] == comparison["n_candidate"] == pairs
    assert comparison["n_reference"] == n
    assert "in alternating 0.2 s windows in one process" in proc.stdout

    out = sweep_dir(tmp_path)
    results = OmegaConf.load(out / "optimization_results.yaml")
    assert results.name == "optuna" and results.study_name == name and len(results.solutions) >= 1
    assert "gpuopt sweep summary" in proc.stdout
    assert "candidate1" in proc.stdout and "95% CI" in proc.stdout
    assert sum(f"trial {i}/4 #" in proc.stdout for i in range(1, 5)) == 4 and "ETA" in proc.stdout

    # the best is the confirmed winner (the baseline unless a candidate is measurably faster),
    # and best.yaml reproduces its training configuration; how the sweep measured (the preset's
    # short windows, the guard's batch) is the user's own again
    from gpuopt.study.records import Confirmation

    assert results.best_trial == Confirmation.from_attr(conf).winner
    best = trials[results.best_trial]
    experiment = _compose(["+experiment=best", f"hydra.searchpath=[file://{out}]"])
    direct = _compose(best.user_attrs["overrides"])
    measured_as = {key: direct.pop(key) for key in ("measure", "guard")}
    assert measured_as["measure"] == best.user_attrs["config"]["measure"]  # the sweep's windows
    defaults = _compose([])
    assert (
        {key: experiment.pop(key) for key in ("measure", "guard")}
        == {key: defaults[key] for key in ("measure", "guard")}
        != measured_as
    )
    assert experiment == direct
    assert experiment["loader"] == best.user_attrs["config"]["loader"]

    # where the time goes, by default for the two trials a user compares (sweeper/profiling.py):
    # the baseline trial ran its profiled window (its recorded overrides stay without it) ...
    assert isinstance(baseline.user_attrs["profile"], dict) and baseline.user_attrs["profile"]
    assert "profile=on" not in baseline.user_attrs["overrides"]
    assert not any(isinstance(t.user_attrs.get("profile"), dict) for t in trials[1:])
    # ... and the best, when it is another trial, got one profiled run after the sweep
    if best.number != baseline.number:
        assert study.user_attrs["best_profile"]["trial"] == best.number
        assert study.user_attrs["best_profile"]["profile"]
    else:
        assert "best_profile" not in study.user_attrs
    _assert_trial_files_on_the_dashboard(tmp_path, study, baseline)


def _assert_trial_files_on_the_dashboard(tmp_path: Path, study: optuna.Study, baseline) -> None:
    """Issue 22: each trial's result.json, and the profiled baseline's trace.json.gz, are Optuna
    artifacts beside the study: optuna-dashboard's HTTP API lists and serves them on the trial, and
    optuna.artifacts.download_artifact returns the run directory's bytes."""
    dashboard = pytest.importorskip("optuna_dashboard", reason="the `dashboard` extra")
    import json
    import threading
    import urllib.request
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from optuna.artifacts import FileSystemArtifactStore, download_artifact

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:
            pass

    store_dir = tmp_path / "artifacts"  # beside gpuopt.db (hydra.sweeper.artifacts=auto)
    assert study.user_attrs["artifact_store"] == str(store_dir.resolve())
    store = FileSystemArtifactStore(store_dir)
    app = dashboard.wsgi(f"sqlite:///{tmp_path / 'gpuopt.db'}", artifact_store=store)
    server = make_server("127.0.0.1", 0, app, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with urllib.request.urlopen(f"{base}/api/studies", timeout=30) as response:
            (summary,) = json.load(response)["study_summaries"]
        study_id = summary["study_id"]
        with urllib.request.urlopen(f"{base}/api/studies/{study_id}", timeout=30) as response:
            detail = json.load(response)
        trials = detail["trials"]
        listed = {t["number"]: {a["filename"]: a for a in t["artifacts"]} for t in trials}
        assert {"result.json", "trace.json.gz"} <= set(listed[baseline.number])
        assert all("result.json" in files for files in listed.values())
        served = listed[baseline.number]["result.json"]
        trial_id = next(t["trial_id"] for t in trials if t["number"] == baseline.number)
        url = f"{base}/artifacts/{study_id}/{trial_id}/{served['artifact_id']}"
        with urllib.request.urlopen(url, timeout=30) as response:
            over_http = response.read()
    finally:
        server.shutdown()
        server.server_close()
    on_disk = (Path(baseline.user_attrs["run_dir"]) / "result.json").read_bytes()
    assert over_http == on_disk
    assert baseline.user_attrs["artifacts"]["result.json"] == served["artifact_id"]
    trace_id = baseline.user_attrs["artifacts"]["trace.json.gz"]
    download_artifact(artifact_store=store, file_path=str(tmp_path / "t.gz"), artifact_id=trace_id)
    trace = Path(baseline.user_attrs["profile"]["trace_path"]).read_bytes()
    assert (tmp_path / "t.gz").read_bytes() == trace
    best = study.user_attrs.get("best_profile")  # the best's profiled run: a study artifact
    names = {a["filename"] for a in detail["artifacts"]}
    assert best is None or f"trace-best-trial-{best['trial']}.json.gz" in names, names


def _compose(overrides: list[str]) -> dict:
    """The task config `python -m gpuopt.run <overrides>` would run (in-process composition)."""
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401  (registers the schema)

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(config_name="config", overrides=overrides)
    cfg = OmegaConf.to_container(cfg, resolve=False)
    cfg.pop("hydra", None)
    return cfg


def test_out_of_memory_trials_are_infeasible_results_in_fresh_processes(tmp_path):
    # The default launcher (a fresh process per trial); a 1e9-wide layer cannot be allocated.
    ok(
        sweep(
            tmp_path,
            *TINY,
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.study_name=oom",
            "model.width=choice(1000000000)",
            timeout=300,
        )
    )
    trials = load(tmp_path, "oom").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    baseline, oom = trials
    assert (
        baseline.user_attrs[ATTR_BASELINE] and baseline.params == {}
    )  # width 512 is outside the space
    assert baseline.user_attrs["status"] == "ok" and baseline.system_attrs["constraints"] == [
        0.0,
        0.0,
        0.0,
    ]
    assert oom.params == {"model.width": 1000000000}
    assert oom.user_attrs["status"] == "oom" and "allocate" in oom.user_attrs["reason"]
    assert oom.system_attrs["constraints"] == [1.0, 0.0, 0.0] and oom.values == [0.0, 0.0]
    assert Path(oom.user_attrs["run_dir"]).name == f"trial_{oom.number}"


def test_killed_sweep_resumes_to_n_trials(tmp_path):
    args = [
        *TINY,
        *IN_PROCESS,
        "model.width=16",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.study_name=resume",
        "loader.batch_size=choice(8,16,32)",
        "hydra.sweeper.confirm.rounds=0",
    ]
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuopt.run", "-m", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # wait until trial #1 is being measured
            time.sleep(0.2)
            try:
                trials = load(tmp_path, "resume").get_trials(deepcopy=False)
            except Exception:
                continue
            # RUNNING with its params suggested: being measured, not just asked for
            if any(t.number == 1 and t.state == TrialState.RUNNING and t.params for t in trials):
                break
        else:
            pytest.fail("trial #1 never started")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ok(sweep(tmp_path, *args))

    trials = load(tmp_path, "resume").get_trials()
    interrupted = trials[1]
    assert interrupted.state == TrialState.FAIL and interrupted.user_attrs["interrupted"] is True
    assert "interrupted" in interrupted.user_attrs["reason"]
    rerun = [t for t in trials if t.user_attrs.get("rerun_of") == 1]
    assert (
        len(rerun) == 1
        and rerun[0].params == interrupted.params
        and rerun[0].state == TrialState.COMPLETE
    )
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 3  # n_trials is the study's total
    assert sum(bool(t.user_attrs.get(ATTR_BASELINE)) for t in trials) == 1  # the baseline ran once

    ok(sweep(tmp_path, *args[:-1], "hydra.sweeper.n_trials=4", "hydra.sweeper.confirm.rounds=0"))
    trials = load(tmp_path, "resume").get_trials()
    assert len([t for t in trials if t.state == TrialState.COMPLETE]) == 4
    assert sum(bool(t.user_attrs.get(ATTR_BASELINE)) for t in trials) == 1


# ---- bad input: one clear message, no trial ---------------------------------------------------------


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("hydra.sweeper.objectives=[throughput,speed]", "hydra.sweeper.objectives='speed'"),
        ("loader.batchsize=choice(8,16)", "loader.batchsize"),
        ("precision=choice(fp32,bf17)", "precision/bf17"),
        (
            '++hydra.sweeper.params={loader.batch_size:"choice(8,"}',
            "hydra.sweeper.params: loader.batch_size",
        ),
    ],
)
def test_bad_sweep_settings_fail_before_any_trial(tmp_path, arg, message):
    proc = fake(tmp_path, *TINY, *IN_PROCESS, arg, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr and "gpuopt: invalid sweep config" in proc.stderr
    assert not list(tmp_path.glob("sweeps/*/*/trial_*"))
    if (tmp_path / "gpuopt.db").exists():
        assert all(
            not s.n_trials
            for s in optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'gpuopt.db'}")
        )


# ---- every status, through the stand-in engine ---------------------------------------------------------


def test_statuses_are_recorded_and_the_sweep_survives_a_dying_trial(tmp_path):
    # Fresh processes (the default launcher): one trial raises, one's process dies, one diverges.
    proc = ok(
        fake(
            tmp_path,
            *TINY,
            "hydra/sweeper/sampler=grid",
            "hydra.sweeper.study_name=s",
            "hydra.sweeper.max_failure_rate=0.9",
            "model.case=choice(crash,die,diverge)",
            timeout=300,
        )
    )
    trials = load(tmp_path, "s").get_trials()
    assert len(trials) == 4  # the baseline (as composed, outside the grid) + the 3 grid points
    baseline = trials[0]
    assert (
        baseline.user_attrs[ATTR_BASELINE]
        and baseline.params == {}
        and baseline.user_attrs["status"] == "ok"
    )
    by = {t.params.get("model.case"): t for t in trials[1:]}
    assert set(by) == {"crash", "die", "diverge"}
    diverged = by["diverge"]
    assert diverged.state == TrialState.COMPLETE and diverged.user_attrs["status"] == "diverged"
    assert diverged.system_attrs["constraints"] == [0.0, 1.0, 0.0] and diverged.values == [0.0, 0.0]
    crash = by["crash"]
    assert (
        crash.state == TrialState.FAIL and crash.user_attrs["reason"] == "RuntimeError: fake crash"
    )
    assert "RuntimeError" in crash.user_attrs["traceback"]
    died = by["die"]
    assert died.state == TrialState.FAIL
    assert died.user_attrs["reason"] == "exited with code 3 without a result"  # os._exit(3)
    assert "gpuopt sweep summary" in proc.stdout


def test_grid_marks_the_baseline_when_the_composed_config_is_a_grid_point(tmp_path):
    """No extra trial: the grid runs the composed config (batch 32) in its turn, marked baseline."""
    grid = "loader.batch_size=choice(8,16,32)"
    ok(fake(tmp_path, *TINY, *IN_PROCESS, "hydra/sweeper/sampler=grid", grid,
            "hydra.sweeper.study_name=g"))  # fmt: skip
    trials = load(tmp_path, "g").get_trials()
    assert sorted(t.params["loader.batch_size"] for t in trials) == [8, 16, 32]  # each once
    (baseline,) = [t for t in trials if t.user_attrs.get(ATTR_BASELINE)]
    assert baseline.params == {"loader.batch_size": 32} and baseline.user_attrs["status"] == "ok"


def test_too_many_errors_stop_the_sweep_with_a_clear_message(tmp_path):
    proc = fake(
        tmp_path,
        *TINY,
        *IN_PROCESS,
        "hydra.sweeper.study_name=f",
        "hydra.sweeper.n_trials=6",
        "hydra.sweeper.baseline=false",
        "model.case=choice(crash)",
        timeout=120,
    )
    assert proc.returncode == 1
    # As the stock sweeper re-raises it: the last failing trial's exception with its traceback's
    # tail (the task's own frame), then gpuopt's line naming the study's storage that remains.
    err = proc.stderr.splitlines()
    start = err.index("gpuopt: trial #2 failed:")
    assert err[start + 1].startswith("Traceback")
    assert any('raise RuntimeError("fake crash")' in line for line in err[start:])
    (stop,) = [i for i, line in enumerate(err) if line.startswith("gpuopt: sweep stopped:")]
    assert stop > start and err[stop - 1].endswith("RuntimeError: fake crash")
    assert "3 of 3 trials ended with status error" in err[stop]
    assert f"--storage sqlite:///{tmp_path / 'gpuopt.db'}" in err[stop]
    assert len(load(tmp_path, "f").get_trials()) == 3


def test_device_aware_default_preset_drops_poor_choices(tmp_path):
    # The default preset, filtered by what `python -m gpuopt.env --json` says about this machine.
    args = [a for a in TINY if a not in ("~search", "hydra.sweeper.device_aware=false")]
    proc = ok(
        fake(
            tmp_path,
            *args,
            *IN_PROCESS,
            "hydra.sweeper.study_name=d",
            "hydra.sweeper.n_trials=6",
            "hydra.sweeper.confirm.rounds=0",
            "precision=choice(fp32,fp16)",  # a command-line sweep is taken as written
        )
    )
    study = load(tmp_path, "d")
    hardware = study.user_attrs[STUDY_HARDWARE]
    poor = hardware["poor_choices"]  # the env's rows: one per rule of the knob catalogue here
    assert poor, "gpuopt.env reported no poor choices"
    dropped = hardware["dropped"]
    for key, choice, reason in dropped:
        assert f"dropped {key}={choice}" in proc.stdout and reason in proc.stdout
        assert knobs.judge(key, choice, hardware["env"]) == reason
    trials = study.get_trials()
    preset_keys = {
        "loader.batch_size",
        "loader.num_workers",
        "loader.pin_memory",
        "device.num_threads",
    }
    for t in trials:
        for key in preset_keys & set(t.params):
            value = t.params[key]
            assert knobs.judge(key, value, hardware["env"]) is None, (key, value)
    assert trials[-1].distributions["precision"].choices == ("fp32", "fp16")
    if hardware["env"].get("device") == "cpu":
        assert "device.num_threads" in trials[-1].params  # the preset's CPU-only param
    # the preset's fixed measurement settings yield to the user's measure=quick override
    assert all("measure.time_budget_s=2.0" not in t.user_attrs["overrides"] for t in trials)


# ---- gpuopt's own app: its defaults come from its own config ---------------------------------------


def test_own_app_keeps_its_study_and_a_changed_space_is_a_new_study(tmp_path):
    """conf/config.yaml (not the sweeper's code) gives gpuopt's app its SQLite file under
    GPUOPT_OUTPUT_DIR and its baseline; the default study name carries a digest of the search
    space: the same command resumes, a changed space starts a new study instead of crashing."""
    common = [
        "~search",
        "hydra/launcher=basic",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.confirm.rounds=0",
    ]
    first = ok(fake(tmp_path, *common, "loader.batch_size=choice(8,16)"))
    again = ok(fake(tmp_path, *common, "loader.batch_size=choice(8,16)"))
    changed = ok(fake(tmp_path, *common, "loader.batch_size=choice(8,32)"))
    names = sorted(
        s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'gpuopt.db'}")
    )
    assert len(names) == 2 and names[0] != names[1]
    assert "resuming" not in first.stdout + first.stderr
    assert "3/3 counted trials: resuming" in again.stdout + again.stderr
    assert "resuming" not in changed.stdout + changed.stderr
    for name in names:
        trials = load(tmp_path, name).trials
        assert len(trials) == 3 and trials[0].user_attrs.get(ATTR_BASELINE) is True
    assert f"reproduce: python {HELPERS / 'fake_task.py'} --config-dir" in first.stdout
