"""The report on real studies (SQLite, written by the sweeper's own code): content, HTML, export."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator

import optuna
import pytest
from rich.console import Console

from gpuopt.core.result import ATTR_CONFIG, Status
from gpuopt.report.build import build_report
from gpuopt.report.charts import figures
from gpuopt.report.cli import main
from gpuopt.report.diagnose import Bottleneck
from gpuopt.report.text import render
from gpuopt.study.keys import ATTR_BASELINE, STUDY_CONFIRMATION, STUDY_DIRECTIONS, STUDY_OBJECTIVES
from gpuopt.sweeper import owners, resume
from tests.helpers.report_studies import (
    CPU_STUDY,
    CPU_TRIALS,
    DISTRIBUTIONS,
    GPU_STUDY,
    Planned,
    add_trials,
    build_cpu_study,
    build_gpu_study,
    build_study,
    confirmation_record,
    cpu_params,
    fast_storage_dir,
    input_bound_metrics,
)

CONFIRMED = "mlp-loader-cpu2-confirmed"
TIED = "mlp-loader-cpu2-tied"
NOT_DONE = "nothing-finished"
IMPORTANCE = "importance-sign"


def importance_trials() -> list[Planned]:
    """Throughput is top only with batch 128 (and workers > 0); bottom whenever workers = 0.
    "Which parameters mattered" for a maximized objective must name the batch size."""
    planned = []
    for batch in (32, 128, 256):
        for workers in (0, 1, 2):
            throughput = 100.0 if workers == 0 else (5000.0 if batch == 128 else 1000.0)
            planned.append(
                Planned(
                    cpu_params(batch, workers), metrics=input_bound_metrics(throughput, 2.0, 97.0)
                )
            )
    return planned


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Iterator[str]:
    with fast_storage_dir(tmp_path_factory.mktemp("studies")) as folder:
        url = f"sqlite:///{folder / 'gpuopt.db'}"
        rdb = optuna.storages.RDBStorage(url)
        build_cpu_study(rdb)
        build_gpu_study(rdb)
        # the trials the confirmation names (#0, #1, #5) and those between them
        build_study(
            rdb, CONFIRMED, CPU_TRIALS[:6], study_attrs={STUDY_CONFIRMATION: confirmation_record()}
        )
        build_study(
            rdb, TIED, CPU_TRIALS[:6], study_attrs={STUDY_CONFIRMATION: confirmation_record(True)}
        )
        build_study(
            rdb,
            NOT_DONE,
            [
                Planned(cpu_params(32, 0), status=Status.ERROR),
                Planned(cpu_params(64, 0), running=True),
            ],
            compose=False,
        )
        build_study(rdb, IMPORTANCE, importance_trials(), compose=False)
        rdb.remove_session()
        yield url


def report_of(storage: str, name: str):
    return build_report(optuna.load_study(study_name=name, storage=storage), storage)


def rendered(report) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    render(report, console, limit=None)
    return console.file.getvalue()


def test_counts_baseline_best_and_speedup(storage):
    report = report_of(storage, CPU_STUDY)
    assert report.counts == {"ok": 7, "oom": 1, "diverged": 1, "error": 1, "running": 1}
    assert report.baseline.number == 0
    assert (
        report.best.number == 5
    )  # highest throughput among feasible ok trials; #2 (oom) is told 0
    assert report.speedup == pytest.approx(2500 / 1000)
    assert report.confirmation is None


def test_change_to_apply_is_the_diff_against_the_baseline(storage):
    report = report_of(storage, CPU_STUDY)
    # precision=fp32 is in both trials' overrides: not a change
    assert report.override_changes == [
        "loader.batch_size=128",
        "loader.num_workers=2",
        "optimizer=sgd",
    ]
    changes = {c.key: (c.baseline, c.best) for c in report.config_changes}
    # the group choice optimizer=sgd shows up in the resolved config as name and lr
    assert changes == {
        "loader.batch_size": (32, 128),
        "loader.num_workers": (0, 2),
        "optimizer.name": ("adamw", "sgd"),
        "optimizer.lr": (0.001, 0.01),
    }


def test_diagnoses_per_trial(storage):
    cpu = {t.number: t.diagnosis for t in report_of(storage, CPU_STUDY).trials}
    assert cpu[0].bottleneck is Bottleneck.INPUT and any("42.0%" in e for e in cpu[0].evidence)
    assert cpu[5].bottleneck is Bottleneck.COMPUTE and "MFU unknown" in cpu[5].summary
    assert cpu[2].bottleneck is Bottleneck.NOT_MEASURED  # oom
    # the GPU study's trials carry env.device = cuda:0: NVML utilization and MFU count there
    gpu = {t.number: t.diagnosis.bottleneck for t in report_of(storage, GPU_STUDY).trials}
    assert gpu == {
        0: Bottleneck.HOST,
        1: Bottleneck.MEMORY_OR_SMALL_KERNELS,
        2: Bottleneck.NEAR_LIMIT,
        3: Bottleneck.COMPUTE,
        4: Bottleneck.COMPUTE,
        5: Bottleneck.NOT_MEASURED,
    }


def test_multi_objective_pareto_front_and_best(storage):
    report = report_of(storage, GPU_STUDY)
    assert report.multi_objective and report.objectives == ["throughput", "peak_memory_mb"]
    # #1 and #4 are dominated by #2; the oom trial (peak memory told as +inf) is infeasible
    assert sorted(t.number for t in report.pareto) == [0, 2, 3]
    assert report.best.number == 2  # the Pareto trial with the best first objective
    text = rendered(report)
    # no two of its trials are within noise of each other: 3 choices (gpuopt.study.noise)
    assert "Pareto front (3 choices beyond noise, 3 trials)" in text
    titles = [
        title
        for title, _ in figures(optuna.load_study(study_name=GPU_STUDY, storage=storage), report)
    ]
    assert "Pareto front" in titles and not any("importances" in t for t in titles)  # 5 ok trials
    assert "near the compute limit" in text and "host/launch-bound" in text


def test_confirmed_winner_is_the_best_and_its_ci_is_shown(storage):
    report = report_of(storage, CONFIRMED)
    # #5 measured highest once, but the interleaved re-measurement ranks #1 first (the sweeper's
    # pick)
    assert report.best.number == 1
    assert report.override_changes == ["loader.batch_size=64", "loader.num_workers=2"]
    text = rendered(report)
    assert re.search(r"candidate2 \(trial #1, the best\) vs baseline: 1\.\d+x \[95% CI", text)
    assert "top two (candidate1 vs candidate2)" in text
    # a candidate was measurably faster (answer (a) alone keeps the baseline: nothing at its batch)
    assert "no candidate is measurably faster than the baseline" not in text
    assert "(no trial held global batch 32)" in text


def test_a_confirmation_without_a_measurably_faster_candidate_keeps_the_baseline(storage):
    report = report_of(storage, TIED)
    assert report.best is report.baseline and report.best.number == 0
    text = rendered(report)
    assert "no candidate is measurably faster than the baseline: keep your configuration" in text
    assert "The baseline is the best trial: nothing to change." in text
    assert "Not confirmed: trial" not in text  # #5's lucky single measurement is not news


def test_parameter_importance_follows_the_objective_direction(storage):
    importances = report_of(storage, IMPORTANCE).importances["throughput"]
    assert set(importances) == {"loader.batch_size", "loader.num_workers"}
    assert max(importances, key=importances.get) == "loader.batch_size"
    assert sum(importances.values()) == pytest.approx(1.0)
    # too few ok trials: a note instead of numbers
    gpu = report_of(storage, GPU_STUDY)
    assert gpu.importances == {} and "need >= " in gpu.importance_note


def test_interrupted_baseline_is_counted_and_its_rerun_is_the_baseline():
    study = optuna.create_study(directions=["maximize"])  # in memory: no file needed here
    study.set_user_attr(STUDY_OBJECTIVES, ["throughput"])
    study.set_user_attr(STUDY_DIRECTIONS, ["maximize"])
    params = cpu_params(32, 0)
    study.enqueue_trial(params, user_attrs={ATTR_BASELINE: True})
    trial = study.ask({k: DISTRIBUTIONS[k] for k in params})
    # its sweeping process "died": same pid, other start time (how resume tells a reused pid)
    owner = {**owners.this_owner(), "start": -1}
    study._storage.set_trial_system_attr(trial._trial_id, resume.ATTR_OWNER, owner)
    assert resume.recover_interrupted(study) == [0]  # FAIL + the same params queued again
    metrics = input_bound_metrics(1000, 42.0, 55.0)
    add_trials(study, [Planned(params, metrics=metrics, enqueue=False)], compose=False)
    report = build_report(study)
    assert report.counts["interrupted"] == 1 and report.counts["ok"] == 1
    assert report.counts["error"] == 0
    assert report.baseline.number == 1 and report.best.number == 1  # the re-run, not #0


def test_surplus_trials_are_void_in_the_report_not_errors():
    """A trial asked but never run (another worker held the study's n_trials) is `void`: the
    report used to count it as an error."""
    study = optuna.create_study(directions=["maximize"])
    study.set_user_attr(STUDY_OBJECTIVES, ["throughput"])
    study.set_user_attr(STUDY_DIRECTIONS, ["maximize"])
    metrics = input_bound_metrics(1000, 42.0, 55.0)
    add_trials(study, [Planned(cpu_params(32, 0), metrics=metrics)], compose=False)
    resume.void(study, study.ask(), "surplus: other workers hold n_trials=1")
    report = build_report(study)
    assert report.counts["void"] == 1 and report.counts["error"] == 0
    assert [t.status for t in report.trials] == ["ok", "void"]
    text = io.StringIO()
    render(report, Console(file=text, width=200))
    assert "void" in text.getvalue()


def test_study_without_completed_trials(storage):
    report = report_of(storage, NOT_DONE)
    assert report.best is None and report.counts["error"] == 1 and report.counts["running"] == 1
    assert "No completed ok trial in this study yet (1 running)" in rendered(report)


def test_text_report_content(storage):
    text = rendered(report_of(storage, CPU_STUDY))
    for expected in (
        "Trials by status",
        "read 2.50x the baseline's throughput",
        "Overrides: loader.batch_size=128 loader.num_workers=2 optimizer=sgd",
        "override /optimizer: sgd",
        "input-bound: the step waits for data",
        "more DataLoader workers: loader.num_workers (now 0)",
        "No confirmation recorded",
        "Which parameters mattered",
    ):
        assert expected in text, expected


def test_html_is_self_contained(storage, tmp_path, capsys):
    path = tmp_path / "report.html"
    assert main(["--storage", storage, "--study", CPU_STUDY, "--html", str(path)]) == 0
    page = path.read_text()
    assert not re.search(
        r"<script[^>]+src\s*=\s*[\"']?(https?:)?//", page, re.IGNORECASE
    )  # nothing fetched
    assert not re.search(r"<link[^>]+href\s*=\s*[\"']?(https?:)?//", page, re.IGNORECASE)
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js inlined
    for title in (
        "Optimization history",
        "Parameter importances (throughput)",
        "Parallel coordinates",
        "Throughput vs batch size, by precision",
    ):
        assert title in page
    assert "Not confirmed: trial #" in page  # the text report is in the page too
    assert f"Wrote {path}" in capsys.readouterr().out


def test_html_without_plotly_keeps_the_text_and_says_why(storage, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "plotly", None)  # `import plotly` now raises ImportError
    path = tmp_path / "report.html"
    assert main(["--storage", storage, "--study", CPU_STUDY, "--html", str(path)]) == 0
    page = path.read_text()
    assert "pip install &#x27;gpuopt[report]&#x27;" in page and "Plotly.newPlot" not in page
    assert "Not confirmed: trial #" in page


def test_export_best_reproduces_the_best_config(storage, tmp_path, capsys):
    from hydra import compose, initialize_config_search_path
    from omegaconf import OmegaConf

    path = tmp_path / "experiment" / "best_cpu.yaml"
    assert main(["--storage", storage, "--study", CPU_STUDY, "--export-best", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Verified: the export composes to trial #5's resolved config" in out
    assert f"--config-dir {tmp_path} +experiment=best_cpu" in out
    text = path.read_text()
    assert text.startswith("# @package _global_")
    assert "override /optimizer: sgd" in text

    # What `python -m gpuopt.run --config-dir tmp_path +experiment=best_cpu` composes:
    with initialize_config_search_path(["pkg://gpuopt.conf", f"file://{tmp_path}"]):
        cfg = compose(config_name="config", overrides=["+experiment=best_cpu"])
    composed = OmegaConf.to_container(cfg, resolve=True)
    best = optuna.load_study(study_name=CPU_STUDY, storage=storage).trials[5]
    assert composed == best.user_attrs[ATTR_CONFIG]
    assert composed["loader"]["batch_size"] == 128 and composed["optimizer"]["lr"] == 0.01


def test_export_without_an_ok_trial_is_an_error(storage, tmp_path, capsys):
    path = tmp_path / "best.yaml"
    assert main(["--storage", storage, "--study", NOT_DONE, "--export-best", str(path)]) == 2
    assert "no completed ok trial to export" in capsys.readouterr().err
    assert not path.exists()


def test_trial_detail(storage, capsys):
    assert main(["--storage", storage, "--study", CPU_STUDY, "--trial", "2"]) == 0
    out = capsys.readouterr().out
    assert "Trial #2 (oom)" in out and "loader.batch_size=1024" in out and "oom: test" in out
    assert main(["--storage", storage, "--study", CPU_STUDY, "--trial", "99"]) == 2
    assert "no trial #99" in capsys.readouterr().err


def test_cpu_trials_table_matches_the_plan():
    # guards the fixture itself: the tests above rely on #0 being the baseline and #5 the best
    assert (
        CPU_TRIALS[0].baseline
        and max(
            (t for t in CPU_TRIALS if t.status is Status.OK and not t.running),
            key=lambda t: t.metrics["throughput"],
        )
        is CPU_TRIALS[5]
    )
