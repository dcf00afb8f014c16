"""`python -m gpuopt.report` as a user runs it (each run a process of its own, forked from one that
has the report's modules imported: tests/helpers/forked_cli.py), and the study read by Optuna's own
tools: the `optuna` CLI and optuna-dashboard's HTTP API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import optuna
import pytest

from tests.helpers.report_studies import (
    CPU_STUDY,
    GPU_STUDY,
    build_cpu_study,
    build_gpu_study,
    fast_storage_dir,
)


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory) -> Iterator[Path]:
    """A GPUOPT_OUTPUT_DIR holding gpuopt.db with two studies; the CPU one is the latest."""
    with fast_storage_dir(tmp_path_factory.mktemp("outputs")) as folder:
        rdb = optuna.storages.RDBStorage(f"sqlite:///{folder / 'gpuopt.db'}")
        build_gpu_study(rdb)
        build_cpu_study(rdb)
        rdb.remove_session()
        yield folder


def url_of(output_dir: Path) -> str:
    return f"sqlite:///{output_dir / 'gpuopt.db'}"


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def report(cli_forks, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m gpuopt.report *args` in a process of its own (forked: tests/helpers/forked_cli.py)."""
    return cli_forks.run("gpuopt.report", args, cwd, {**os.environ, **env})


def test_default_storage_lists_studies_and_reports_the_latest(output_dir, tmp_path, cli_forks):
    proc = report(cli_forks, [], tmp_path, GPUOPT_OUTPUT_DIR=str(output_dir))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Studies" in out and GPU_STUDY in out and f"{CPU_STUDY} <" in out  # the latest, marked
    assert f"Study {CPU_STUDY}" in out and f"Study {GPU_STUDY}" not in out
    assert "read 2.50x the baseline's throughput" in out
    assert "Traceback" not in proc.stderr


def test_missing_storage_is_a_message_not_a_traceback(tmp_path, cli_forks):
    empty = tmp_path / "nothing-here"
    proc = report(cli_forks, [], tmp_path, GPUOPT_OUTPUT_DIR=str(empty))
    assert proc.returncode == 2
    assert f"no study database at {empty / 'gpuopt.db'} (GPUOPT_OUTPUT_DIR={empty})" in proc.stderr
    assert "python -m gpuopt.run -m" in proc.stderr and "Traceback" not in proc.stderr
    assert not (empty / "gpuopt.db").exists()  # never creates an empty database


def test_unknown_study_names_the_known_ones(output_dir, tmp_path, cli_forks):
    proc = report(cli_forks, ["--storage", url_of(output_dir), "--study", "nope"], tmp_path)
    assert proc.returncode == 2
    assert "no study named 'nope'" in proc.stderr
    assert GPU_STUDY in proc.stderr and CPU_STUDY in proc.stderr and "Traceback" not in proc.stderr


def test_optuna_cli_reads_the_study(output_dir, tmp_path):
    optuna_cli = str(Path(sys.executable).parent / "optuna")
    studies = run([optuna_cli, "studies", "--storage", url_of(output_dir), "-f", "json"], tmp_path)
    assert studies.returncode == 0, studies.stderr
    by_name = {s["name"]: s for s in json.loads(studies.stdout)}
    assert by_name[CPU_STUDY]["n_trials"] == 11
    assert by_name[GPU_STUDY]["user_attrs"]["objectives"] == ["throughput", "peak_memory_mb"]

    trials = run(
        [
            optuna_cli,
            "trials",
            "--storage",
            url_of(output_dir),
            "--study-name",
            CPU_STUDY,
            "-f",
            "json",
        ],
        tmp_path,
    )
    assert trials.returncode == 0, trials.stderr
    rows = {t["number"]: t for t in json.loads(trials.stdout)}
    assert rows[0]["user_attrs"]["baseline"] is True and rows[0]["user_attrs"]["data_wait"] == 42.0
    assert rows[2]["user_attrs"]["status"] == "oom" and rows[4]["state"] == "FAIL"
    assert rows[5]["user_attrs"]["overrides"] == [
        "loader.batch_size=128",
        "loader.num_workers=2",
        "precision=fp32",
        "optimizer=sgd",
    ]


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # keep the test output clean
        pass


def test_optuna_dashboard_shows_gpuopt_attributes(output_dir):
    dashboard = pytest.importorskip("optuna_dashboard", reason="the `dashboard` extra")
    app = dashboard.wsgi(url_of(output_dir))
    server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with urllib.request.urlopen(f"{base}/api/studies", timeout=30) as response:
            summaries = json.load(response)["study_summaries"]
        study_id = next(s["study_id"] for s in summaries if s["study_name"] == CPU_STUDY)
        with urllib.request.urlopen(f"{base}/api/studies/{study_id}", timeout=30) as response:
            detail = json.load(response)
    finally:
        server.shutdown()
        server.server_close()
    attrs = {t["number"]: {a["key"]: a["value"] for a in t["user_attrs"]} for t in detail["trials"]}
    assert float(attrs[5]["throughput"]) == 2500 and attrs[5]["status"] == "ok"
    assert attrs[0]["baseline"] == "True" and attrs[2]["status"] == "oom"  # str() of each value
    assert {"throughput", "data_wait", "input_efficiency", "status"} <= {
        a["key"] for a in detail["union_user_attrs"]
    }
    assert [t["number"] for t in detail["best_trials"]] == [5]
    assert {a["key"] for a in detail["user_attrs"]} >= {"objectives", "directions", "hardware"}


def test_journal_storage_is_reported_and_a_missing_journal_is_a_message(
    output_dir, tmp_path, cli_forks
):
    """Studies shared through `hydra.sweeper.storage=journal:///...` are reviewed the same way."""
    from gpuopt.study.storage import open_storage

    journal = tmp_path / "study.log"
    optuna.copy_study(
        from_study_name=CPU_STUDY,
        from_storage=url_of(output_dir),
        to_storage=open_storage(f"journal://{journal}", heartbeat_interval=None, grace_period=None),
    )
    proc = report(cli_forks, ["--storage", f"journal://{journal}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"Study {CPU_STUDY}" in proc.stdout
    assert "read 2.50x the baseline's throughput" in proc.stdout

    missing = tmp_path / "nope.log"
    proc = report(cli_forks, ["--storage", f"journal://{missing}"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(missing) in proc.stderr and not missing.exists()


def test_unwritable_html_path_fails_before_the_report_is_built(output_dir, tmp_path, cli_forks):
    proc = report(
        cli_forks,
        ["--html", "/proc/gpuopt/report.html"],
        tmp_path,
        GPUOPT_OUTPUT_DIR=str(output_dir),
    )
    assert proc.returncode == 2
    assert proc.stdout == ""  # no studies table, no report: the path is checked first
    (line,) = proc.stderr.strip().splitlines()
    assert "--html='/proc/gpuopt/report.html'" in line and "not writable" in line


def test_export_best_into_a_file_path_fails_before_the_report_is_built(
    output_dir, tmp_path, cli_forks
):
    blocker = tmp_path / "conf"
    blocker.write_text("a file, not a folder")
    proc = report(
        cli_forks,
        ["--export-best", str(blocker / "best.yaml")],
        tmp_path,
        GPUOPT_OUTPUT_DIR=str(output_dir),
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{blocker} is a file" in proc.stderr
