"""`python -m gpuopt.run` through the real CLI (subprocesses; those that end on bad input forked from
one with the CLI's modules imported, tests/helpers/forked_cli.py) and run_config in-process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from gpuopt.core.fmt import limit_share
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.engines._lifecycle import STEAL_WARN_PCT, _process_notes
from gpuopt.run import print_result, run_config
from tests.conftest import TINY_TRIAL
from tests.helpers.cli import run_cli, run_cli_forked

REPO = Path(__file__).resolve().parents[1]


def test_one_trial_prints_a_table_and_writes_result_json_in_the_run_dir(tmp_path):
    proc = run_cli(tmp_path, *TINY_TRIAL, "model.width=16", "model.depth=1")
    assert proc.returncode == 0, proc.stderr
    (result_file,) = (tmp_path / "outputs" / "runs").glob("*/*/result.json")
    result = TrialResult.load(result_file)
    assert result.status is Status.OK and result.metrics.throughput > 0
    assert result.config["loader"]["batch_size"] == 8 and result.config["model"]["width"] == 16
    assert "hydra" not in result.config
    assert "throughput" in proc.stdout and "result.json" in proc.stdout
    assert f"{result.metrics.throughput:,.1f} samples/s" in proc.stdout
    # what the sweep summary says of a trial, in its words: the limit's share and bound
    m = result.metrics
    share = limit_share(dataclasses.asdict(m))
    assert share is not None and f"at {share}" in proc.stdout and "bound by cores" in share
    assert f"{m.throughput_amortized:,.1f} samples/s" in _row(proc.stdout, "throughput (amortized)")
    assert f"{m.mfu_achievable:,.2f} %" in _row(proc.stdout, "MFU (achievable)")
    if m.cpu_steal_pct is not None:  # Linux: /proc/stat
        assert f"{m.cpu_steal_pct:,.1f} %" in _row(proc.stdout, "CPU steal")


def _row(table: str, name: str) -> str:
    (line,) = [line for line in table.splitlines() if f" {name} " in line]
    return line


def _printed(result: TrialResult) -> str:
    console = Console(record=True, width=250)
    print_result(result, console=console)
    return console.export_text()


def test_rows_of_what_a_trial_did_not_measure_are_absent_and_a_high_steal_is_warned():
    unmeasured = _printed(TrialResult(status=Status.OK, metrics=Metrics(throughput=100.0)))
    for name in ("throughput (amortized)", "machine limit", "MFU (achievable)", "CPU steal"):
        assert f" {name} " not in unmeasured
    assert " MFU " in unmeasured  # the always-shown rows keep their "-"

    steal = STEAL_WARN_PCT + 7
    metrics = Metrics(
        throughput=100.0,
        cpu_steal_pct=steal,
        limit_throughput=400.0,
        limit_efficiency=25.0,
        limit_bound="loader",
    )
    warnings = _process_notes(SimpleNamespace(metrics=metrics), earlier_trial=False)
    text = _printed(TrialResult(status=Status.OK, metrics=metrics, warnings=warnings))
    assert f"{steal:.1f} %" in _row(text, "CPU steal")
    (line,) = [line for line in text.splitlines() if line.startswith("warning:")]
    assert f"{steal:.0f}% of this machine's CPU time" in line and "cpu_steal_pct" in line
    limit = _row(text, "machine limit")
    assert "400.0 samples/s" in limit
    assert (
        "at 25% of this machine's limit for this workload (400 samples/s, bound by loader)" in limit
    )


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("loader.batch_size=0", "invalid config: loader.batch_size=0; allowed: an integer >= 1"),
        (
            "model._target_=os.system",
            "invalid config: model._target_='os.system'; allowed: targets matching",
        ),
    ],
)
def test_invalid_value_exits_nonzero_with_one_line(tmp_path, cli_forks, override, expected):
    proc = run_cli_forked(cli_forks, tmp_path, override)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]
    assert not (tmp_path / "outputs" / "runs").exists() or not list(
        (tmp_path / "outputs").rglob("result.json")
    )


def test_unknown_group_option_is_hydras_error_listing_the_options(tmp_path, cli_forks):
    proc = run_cli_forked(cli_forks, tmp_path, "precision=fp8")
    assert proc.returncode != 0
    assert "precision/fp8" in proc.stderr and "bf16" in proc.stderr


def test_import_of_the_task_module_does_not_import_torch():
    code = "import sys, gpuopt.run; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_config_error_exits_in_a_single_run(compose_cfg, capsys):
    with pytest.raises(SystemExit) as info:
        run_config(compose_cfg(*TINY_TRIAL, "precision=tf32"))
    assert info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "precision.mode='tf32'" in err


def test_config_error_in_multirun_is_an_error_result(compose_cfg, tmp_path):
    result = run_config(
        compose_cfg(*TINY_TRIAL, "loader.num_workers=-2"), output_dir=tmp_path, multirun=True
    )
    assert result.status is Status.ERROR and "loader.num_workers=-2" in result.reason
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["status"] == "error" and saved["config"]["loader"]["num_workers"] == -2


def test_user_model_from_own_config_dir_as_the_readme_shows(tmp_path, cli_forks):
    """README "Your own model and dataset": a model YAML in the user's folder, trusted by `trust`.
    The trusted run also sets an allocator (`cache=cpu_thp`): the callback imports the user's model
    (and torch) before the job, and the setting must still apply (set first), one trial for both."""
    model_dir = tmp_path / "myconf" / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "tinynet.yaml").write_text(
        "_target_: tests.helpers.user_models.TinyNet\n"
        "input: vectors\n"
        "input_shape: [12]\n"
        "num_classes: 3\n"
        "features: ${.input_shape[0]}\n"
        "classes: ${.num_classes}\n"
        "hidden: 7\n"
    )
    untrusted = run_cli_forked(
        cli_forks, tmp_path, "--config-dir", str(tmp_path / "myconf"), "model=tinynet", *TINY_TRIAL
    )
    assert untrusted.returncode != 0
    assert "model._target_='tests.helpers.user_models.TinyNet'" in untrusted.stderr
    assert "trust=[tests.helpers.user_models.*]" in untrusted.stderr

    proc = run_cli(
        tmp_path,
        "--config-dir",
        str(tmp_path / "myconf"),
        "model=tinynet",
        "trust=[tests.*]",
        *TINY_TRIAL,
        "cache=cpu_thp",
    )
    assert proc.returncode == 0, proc.stderr
    (result_file,) = (tmp_path / "outputs" / "runs").glob("*/*/result.json")
    result = TrialResult.load(result_file)
    assert result.status is Status.OK and result.metrics.throughput > 0
    assert result.config["model"]["hidden"] == 7 and result.config["data"]["shape"] == [12]
    assert result.config["cache"]["cpu_thp"] is True  # the allocator setting, as run
    assert not [w for w in result.warnings if "did not apply" in w], result.warnings


def test_bad_input_is_exit_2_before_the_run_dir_exists(tmp_path, cli_forks):
    proc = run_cli_forked(cli_forks, tmp_path, "model.depth=-2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpuopt: invalid config: model.depth=-2; allowed: an integer >= 1"
    assert not (tmp_path / "outputs").exists()


def _gpuopt_command(
    tmp_path: Path, override: str, full_error: str | None
) -> subprocess.CompletedProcess:
    """The installed `gpuopt` console script (pyproject's [project.scripts]), as a user runs it,
    with the user's HYDRA_FULL_ERROR (None: unset)."""
    command = Path(sys.executable).with_name("gpuopt")
    assert command.is_file(), "no gpuopt command: `pip install -e .` registers it"
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path / "outputs")}
    env.pop("HYDRA_FULL_ERROR", None)
    env.update({} if full_error is None else {"HYDRA_FULL_ERROR": full_error})
    return subprocess.run(
        [str(command), override], cwd=tmp_path, env=env, capture_output=True, text=True
    )


def test_the_gpuopt_command_reports_a_composition_error_in_one_line_with_exit_2(tmp_path):
    """The console script goes through `cli()`: Hydra's own report of a missing option would be
    several lines and exit 1."""
    proc = _gpuopt_command(tmp_path, "model=nope", None)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpuopt: invalid config: model='nope'; allowed: cnn |")
    assert not (tmp_path / "outputs").exists()


def test_hydra_full_error_set_by_the_user_still_shows_the_full_traceback(tmp_path):
    proc = _gpuopt_command(tmp_path, "model=nope", "1")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "MissingConfigException" in proc.stderr


def test_a_process_that_did_not_come_through_cli_keeps_its_hydra_full_error(monkeypatch):
    """A launcher's job (or `main` called directly) never passed through `cli()`: the callback's
    restore leaves the user's HYDRA_FULL_ERROR as it is."""
    from gpuopt import run

    monkeypatch.setattr(run, "_user_full_error", None)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    run.ValidateBeforeRun().on_multirun_start(None)
    assert os.environ["HYDRA_FULL_ERROR"] == "1"
