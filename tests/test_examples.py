"""examples/: a user's own lightning-hydra-template-style app, swept by gpuopt as a subprocess, with
its metrics read back from the study; and the sweeper's reading of a dict of named metrics (the
app's `returns=metrics`; what the summary says of a task that reports no global batch:
tests/test_same_training.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from gpuopt.study.keys import (
    ATTR_BASELINE,
    STUDY_BATCH_RULE,
    STUDY_OBJECTIVES,
)
from gpuopt.sweeper.global_batch import BatchRule
from gpuopt.sweeper.objectives import outcome_from_return

APP = Path(__file__).resolve().parent.parent / "examples" / "lightning_hydra_app"
# Tiny: the baseline and one searched trial of a quick window over a small search space. Each run
# is a fresh process that imports Lightning (seconds), so the fewer runs the better; no device
# probe (`python -m gpuopt.env`: device-aware presets are tested by tests/test_user_script.py's
# and tests/test_race.py's sweeps, and this space has none).
TINY_SWEEP = [
    "hparams_search=throughput",
    "hydra.sweeper.device_aware=false",
    "measure=quick",
    "measure.time_budget_s=0.3",
    "measure.min_time_s=0.2",
    "hydra.sweeper.n_trials=2",
    "data.num_workers=0",  # the searched keys below: batch size only
    "hydra.sweeper.params={data.batch_size: 'choice(32, 128)'}",
]
# No confirmation: a Lightning app's confirmed sweep (its runs in fresh processes, both answers
# confirmed) is the real lightning-hydra-template's, tests/test_stock_apps.py; one in all.
NO_CONFIRMATION = "hydra.sweeper.confirm.rounds=0"


def _sweep(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path), "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [sys.executable, str(APP / "src" / "train.py"), "-m", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _study(tmp_path: Path) -> optuna.Study:
    storage = f"sqlite:///{tmp_path / 'gpuopt.db'}"
    return optuna.load_study(study_name="lightning_hydra_app", storage=storage)


@pytest.mark.slow
def test_the_example_app_is_swept_with_named_objectives_and_a_baseline(tmp_path):
    pytest.importorskip("lightning")
    proc = _sweep(tmp_path, *TINY_SWEEP, NO_CONFIRMATION)
    study = _study(tmp_path)
    trials = study.get_trials()
    assert len(trials) == 2 and all(t.state is TrialState.COMPLETE for t in trials), trials
    # No launcher chosen: gpuopt's metrics are the objectives, so every trial ran in a fresh
    # process of its own (submitit's job folders), not in the sweep's.
    assert "trials run in fresh processes (hydra/launcher=fresh_process)" in proc.stdout
    jobs = {p.parent for p in tmp_path.rglob(".submitit/*/*_log.out")}
    assert len(jobs) == len(trials), sorted(jobs)
    assert study.user_attrs[STUDY_OBJECTIVES] == ["throughput", "data_wait"]
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    baseline = [t for t in trials if t.user_attrs.get(ATTR_BASELINE)]
    assert len(baseline) == 1  # the config as composed (batch size 64): no searched override
    for trial in trials:
        searched = any(o.startswith("data.batch_size=") for o in trial.user_attrs["overrides"])
        assert searched is (trial is not baseline[0])
    for trial in trials:  # every metric is a user attribute; the values are the named metrics
        attrs = trial.user_attrs
        assert attrs["status"] == "ok" and attrs["config"]["engine"]["name"] == "lightning_callback"
        assert trial.values == [attrs["throughput"], attrs["data_wait"]]
        assert attrs["timed_steps"] >= 2 and attrs["flops_per_sample"] > 0
        assert attrs["step_time_ms"] > 0 and attrs["peak_memory_mb"] is not None
    assert "gpuopt sweep summary" in proc.stdout
    # What each trial trains on, read from the Trainer (issue 22): a batch change is never called
    # the same training; (a) is the baseline itself, (b) says what the batch change does.
    for trial in trials:
        batch = trial.params.get("data.batch_size", 64)
        assert (trial.user_attrs["global_batch"], trial.user_attrs["micro_batch"]) == (batch, batch)
        assert trial.user_attrs["accumulation_steps"] == 1 and trial.user_attrs["lr"] == 0.001
    # The app declared no batch keys: the sweep took the searched key named like a batch size
    # (and said so), so its same-training answer (a) is searched at global batch 64.
    assert "batch_keys not set: ['data.batch_size']" in proc.stdout + proc.stderr
    rule = BatchRule.from_attr(study.user_attrs[STUDY_BATCH_RULE])
    assert rule is not None and rule.factors == ("data.batch_size",)
    assert "(a) same training: " in proc.stdout
    # (b), unconfirmed: the higher throughput; which trial that is is the machine's to say, what
    # the summary says of it is checked either way (a batch change says what it changes)
    best = max(trials, key=lambda t: t.values[0])
    if best.number == 1:
        batch = best.params["data.batch_size"]
        assert "(b) best overall: #1 " in proc.stdout, proc.stdout[-3000:]
        assert f"changes the training: global batch 64 -> {batch} " in proc.stdout
    else:
        assert "(b) best overall: #1 " not in proc.stdout, proc.stdout[-3000:]
    report = subprocess.run(
        [sys.executable, "-m", "gpuopt.report", "--study", "lightning_hydra_app",
         "--storage", f"sqlite:///{tmp_path / 'gpuopt.db'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    assert "Baseline vs best" in report.stdout


def test_a_dict_of_named_metrics_is_read_like_a_trial_result():
    names, dirs = ["throughput", "data_wait"], ["maximize", "minimize"]
    outcome = outcome_from_return(
        {"throughput": 10.0, "data_wait": 2.0, "val_acc": 0.9}, names, dirs
    )
    assert outcome.status == "ok" and outcome.values == [10.0, 2.0]
    assert outcome.user_attrs["val_acc"] == 0.9 and outcome.user_attrs["throughput"] == 10.0
    assert outcome.constraints == {"oom": 0.0, "diverged": 0.0, "numerics": 0.0}
    oom = outcome_from_return({"status": "oom", "reason": "CUDA out of memory"}, names, dirs)
    assert oom.status == "oom" and oom.values == [0.0, float("inf")] and oom.constraints["oom"] == 1
    missing = outcome_from_return({"val_acc": 0.9}, names, dirs)
    assert missing.failed and "throughput" in missing.user_attrs["reason"]
    assert outcome_from_return({"status": "weird"}, names, dirs).failed


def test_a_metric_of_the_tasks_own_can_be_an_objective():
    names, dirs = ["throughput", "val_acc"], ["maximize", "maximize"]
    outcome = outcome_from_return({"throughput": 10.0, "val_acc": 0.9}, names, dirs)
    assert outcome.status == "ok" and outcome.values == [10.0, 0.9]
    for bad in ({"throughput": 10.0}, {"throughput": 10.0, "val_acc": "high"}):
        missing = outcome_from_return(bad, names, dirs)
        assert missing.failed and "'val_acc' is not a number" in missing.user_attrs["reason"]
