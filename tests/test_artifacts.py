"""Trial files in Optuna's artifact store (gpuopt/sweeper/trial_artifacts.py, gpuopt/study/artifact_store.py):
where the store is, a user task's returned result as result.json, a failing upload or a storage
without a file as a warning, and the report page as a study artifact. The sweep through
optuna-dashboard's HTTP API: tests/test_sweep_e2e.py."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from optuna.artifacts import FileSystemArtifactStore, download_artifact, get_all_artifact_meta

from gpuopt.core._compat import storage_of
from gpuopt.core.errors import SweepConfigError
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.study.artifact_store import store_page
from gpuopt.study.keys import ATTR_ARTIFACTS, STUDY_ARTIFACT_STORE
from gpuopt.sweeper.objectives import outcome_from_return
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.sweeper.record import record_trial
from gpuopt.sweeper.trial_artifacts import TrialFiles, store_dir

NAMES, DIRECTIONS = ["throughput"], ["maximize"]


def test_the_store_is_beside_the_studys_file_or_where_the_option_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "out" / "gpuopt.db"
    assert store_dir("auto", f"sqlite:///{db}") == db.parent / "artifacts"
    assert store_dir("auto", "journal://runs/study.log") == tmp_path / "runs" / "artifacts"
    assert store_dir("auto", "postgresql+psycopg://u@host/db") is None  # no file to sit beside
    assert store_dir("auto", None) is None  # in-memory
    assert store_dir("store", f"sqlite:///{db}") == tmp_path / "store"
    assert store_dir(None, f"sqlite:///{db}") is None
    with pytest.raises(SweepConfigError, match=r"hydra\.sweeper\.artifacts"):
        SweeperOptions.build(artifacts="")
    assert SweeperOptions.build(artifacts=None).artifacts is None  # null: off, kept


def test_a_returned_result_is_uploaded_as_result_json_before_the_tell(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", directions=DIRECTIONS)
    files = TrialFiles.for_study("auto", f"sqlite:///{tmp_path / 's.db'}", study)
    assert files is not None and study.user_attrs[STUDY_ARTIFACT_STORE] == str(files.path)
    result = TrialResult(
        status=Status.OK,
        metrics=Metrics(throughput=5.0, global_batch=64),
        warnings=["stored in postgresql+psycopg://me:hunter2@db/x"],  # a secret: never stored
    )
    ret = JobReturn(overrides=[], status=JobStatus.COMPLETED, _return_value=result)
    trial = study.ask()
    outcome = outcome_from_return(result, NAMES, DIRECTIONS)
    files.upload_trial(study, trial, ret, outcome)  # a task of its own: no run dir
    record_trial(study, trial, [], ret, outcome)
    (frozen,) = study.get_trials()
    (meta,) = get_all_artifact_meta(frozen, storage=storage_of(study))
    assert meta.filename == "result.json" and meta.mimetype == "application/json"
    assert frozen.user_attrs[ATTR_ARTIFACTS] == {"result.json": meta.artifact_id}
    target = tmp_path / "back.json"
    download_artifact(
        artifact_store=files.store, file_path=str(target), artifact_id=meta.artifact_id
    )
    assert TrialResult.from_dict(json.loads(target.read_text())).metrics == result.metrics
    assert "hunter2" not in target.read_text() and "me:***@db" in target.read_text()


def test_no_file_to_keep_them_beside_or_a_failing_upload_is_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="gpuopt.sweeper")
    memory = optuna.create_study(directions=DIRECTIONS)
    assert TrialFiles.for_study("auto", None, memory) is None
    assert "hydra.sweeper.artifacts=<directory>" in caplog.text
    caplog.clear()
    assert TrialFiles.for_study(None, None, memory) is None and not caplog.text  # off: silent

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", directions=DIRECTIONS)
    missing = tmp_path / "gone"
    files = TrialFiles(missing, FileSystemArtifactStore(missing))  # its directory is not there
    result = TrialResult(status=Status.OK, metrics=Metrics(throughput=5.0))
    ret = JobReturn(overrides=[], status=JobStatus.COMPLETED, _return_value=result)
    trial = study.ask()
    outcome = outcome_from_return(result, NAMES, DIRECTIONS)
    files.upload_trial(study, trial, ret, outcome)
    assert "result.json not uploaded" in caplog.text and ATTR_ARTIFACTS not in outcome.user_attrs
    record_trial(study, trial, [], ret, outcome)  # the trial is still recorded
    assert study.get_trials()[0].state is optuna.trial.TrialState.COMPLETE


def test_the_report_page_is_a_study_artifact_once_per_page(tmp_path, monkeypatch):
    from gpuopt.report.cli import main

    monkeypatch.setitem(sys.modules, "plotly", None)  # the text page: quick
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="s", storage=url, directions=DIRECTIONS)
    study.enqueue_trial({}, user_attrs={"baseline": True})
    study.optimize(lambda t: 1.0, n_trials=1)
    page = tmp_path / "report.html"
    assert main(["--storage", url, "--study", "s", "--html", str(page)]) == 0
    assert get_all_artifact_meta(study) == []  # no store recorded: the page stays where written
    store = tmp_path / "artifacts"
    store.mkdir()
    study.set_user_attr(STUDY_ARTIFACT_STORE, str(store))
    for _ in range(2):  # the same page twice: stored once
        assert main(["--storage", url, "--study", "s", "--html", str(page)]) == 0
    (meta,) = get_all_artifact_meta(study)
    assert meta.filename == "report.html" and meta.mimetype == "text/html"
    assert (store / meta.artifact_id).read_bytes() == page.read_bytes()
    assert "already in the study's artifact store" in store_page(study, page)
    assert Path(page).is_file()
