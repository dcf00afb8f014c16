"""`python -m gpuopt.report --compare A B`: two trials of a study (by number) or two runs (by their
result.json) side by side: config diff, metrics, diagnoses, phase breakdowns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.report.cli import main
from gpuopt.report.compare import compare, resolve_side
from tests.helpers.profile_studies import (
    BASELINE_PHASES,
    BEST_PHASES,
    build_profiled_cpu_study,
    profile_summary,
)
from tests.helpers.report_studies import fast_storage_dir


@pytest.fixture(scope="module")
def storage_url(tmp_path_factory) -> Iterator[str]:
    with fast_storage_dir(tmp_path_factory.mktemp("compare")) as folder:
        url = f"sqlite:///{folder / 'gpuopt.db'}"
        rdb = optuna.storages.RDBStorage(url)
        build_profiled_cpu_study(rdb)
        rdb.remove_session()
        yield url


def _report(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_two_study_trials_side_by_side(storage_url, capsys):
    code, out, err = _report(["--storage", storage_url, "--compare", "0", "5"], capsys)
    assert code == 0, err
    # Config: the keys the best changed, both values.
    assert (
        "loader.batch_size" in out
        and "loader.num_workers" in out
        and "optimizer._target_" not in out
    )
    assert "trial #0" in out and "trial #5" in out
    # Metrics with B's change against A (2,500 vs 1,000 samples/s).
    assert "x2.50" in out and "42.0%" in out and "2.0%" in out
    # Both were profiled: the phase table, and each diagnosis citing its phases.
    assert "Where the step goes" in out
    assert "53% of the step in next(loader)" in out
    assert "optimizer 18% of the step: try optimizer.fused=true" in out


def test_comparison_data(storage_url):
    from gpuopt.report.build import build_report
    from gpuopt.study.storage import load_study, open_existing

    report = build_report(load_study(open_existing(storage_url), storage_url, None), storage_url)
    c = compare(resolve_side("0", report), resolve_side("5", report))
    keys = {item.key: (item.baseline, item.best) for item in c.config_changes}
    assert keys["loader.batch_size"] == (32, 128) and keys["loader.num_workers"] == (0, 2)
    assert dict((n, (a, b)) for n, a, b in c.metrics)["throughput"] == (1000.0, 2500.0)
    phases = {row.phase: row for row in c.phases}
    assert phases["data_wait"].a_pct == BASELINE_PHASES["data_wait"]
    assert phases["optimizer"].b_pct == BEST_PHASES["optimizer"]
    assert phases["forward"].b_ms == pytest.approx(0.30 * 51.0)
    assert c.gpu == []  # CPU profiles: no GPU split


def _result_json(path: Path, batch: int, throughput: float, profile=None) -> Path:
    result = TrialResult(
        Status.OK,
        Metrics(throughput=throughput, data_wait=1.0, input_efficiency=99.0),
        config={"loader": {"batch_size": batch}, "precision": {"mode": "fp32"}},
        env={"device": "cuda:0"},
        profile=profile,
    )
    path.mkdir(parents=True)
    result.save(path / "result.json")
    return path


def test_two_runs_by_result_json_without_a_study(tmp_path, capsys):
    gpu = {"kernel": 55.0, "memcpy": 5.0, "idle": 40.0, "host_wait": 35.0, "kernel_wait": 5.0,
           "unattributed_idle": 0.0, "busy_by_phase": {}}  # fmt: skip
    a = _result_json(tmp_path / "a", 64, 1000.0, profile_summary(BEST_PHASES, 0.05, gpu))
    b = _result_json(tmp_path / "b", 256, 1500.0)
    missing = tmp_path / "no-such.db"
    code, out, err = _report(
        ["--storage", f"sqlite:///{missing}", "--compare", str(a), str(b / "result.json")], capsys
    )
    assert code == 0, err
    assert not missing.exists()  # no study was opened, none created
    assert "loader.batch_size" in out and "64" in out and "256" in out and "x1.50" in out
    assert "GPU time" in out and "host_wait" in out
    assert "GPU idle 40%, of which 35 points host wait" in out  # A's diagnosis, from its profile


def test_unknown_trial_and_unreadable_result_are_messages(storage_url, tmp_path, capsys):
    code, _, err = _report(["--storage", storage_url, "--compare", "0", "99"], capsys)
    assert code == 2 and "no trial #99" in err
    code, _, err = _report(
        ["--compare", str(tmp_path / "x.json"), str(tmp_path / "y.json")], capsys
    )
    assert code == 2 and "cannot read a trial result" in err
