"""Pure logic of the gpuopt sweeper: fast, table-driven, no sweep launched."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from hydra.errors import HydraDeprecationError
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from gpuopt.core import knobs, lifeline
from gpuopt.core.errors import SweepConfigError
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.core.stats import speedup, t_quantile
from gpuopt.study import storage
from gpuopt.study.experiment import overrides_to_experiment
from gpuopt.study.keys import ATTR_BASELINE
from gpuopt.study.records import Confirmation, ConfirmedConfig
from gpuopt.sweeper import machine as hardware
from gpuopt.sweeper import owners, resume
from gpuopt.sweeper.confirm import schedule as confirm_schedule
from gpuopt.sweeper.confirm.verdicts import compare
from gpuopt.sweeper.objectives import outcome_from_return, resolve_objectives
from gpuopt.sweeper.space import (
    baseline_params,
    choice_text,
    drop_poor_choices,
    parser,
    preset_without_user_keys,
    select_device_params,
)

# ---- objectives ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("objectives", "direction", "names", "directions"),
    [
        (None, None, ["throughput_amortized", "utilization"], ["maximize", "maximize"]),
        (
            ["throughput", "energy_per_sample_j"],
            None,
            ["throughput", "energy_per_sample_j"],
            ["maximize", "minimize"],
        ),
        (["step_time_ms"], None, ["step_time_ms"], ["minimize"]),
        (["throughput"], "maximize", ["throughput"], ["maximize"]),
        (
            None,
            "maximize",
            ["throughput_amortized"],
            ["maximize"],
        ),  # stock config: first len(direction) defaults
        (
            None,
            ["maximize", "maximize"],
            ["throughput_amortized", "utilization"],
            ["maximize", "maximize"],
        ),
        (
            None,
            "minimize",
            ["throughput_amortized"],
            ["minimize"],
        ),  # a stock float task: its value, minimized
        (
            ["throughput", "val_acc"],
            ["maximize", "maximize"],
            ["throughput", "val_acc"],
            ["maximize", "maximize"],
        ),  # a metric of the task's own: its direction is given
    ],
)
def test_resolve_objectives(objectives, direction, names, directions):
    assert resolve_objectives(objectives, direction) == (names, directions)


@pytest.mark.parametrize(
    ("objectives", "direction", "key", "bad"),
    [
        (["throughput", "speed"], None, "hydra.sweeper.objectives", "speed"),
        (["throughput", "speed"], "maximize", "hydra.sweeper.objectives", "speed"),
        (
            ["throughput"],
            ["maximize", "minimize"],
            "hydra.sweeper.direction",
            ["maximize", "minimize"],
        ),
        (
            ["throughput", "throughput"],
            None,
            "hydra.sweeper.objectives",
            ["throughput", "throughput"],
        ),
        (None, "sideways", "hydra.sweeper.direction", "sideways"),
        (None, ["maximize"] * 3, "hydra.sweeper.direction", ["maximize"] * 3),
        ([], None, "hydra.sweeper.objectives", []),
    ],
)
def test_resolve_objectives_errors_name_key_and_value(objectives, direction, key, bad):
    with pytest.raises(SweepConfigError) as info:
        resolve_objectives(objectives, direction)
    assert info.value.key == key and info.value.value == bad
    assert "allowed" in str(info.value)


NAMES, DIRS = ["throughput", "step_time_ms"], ["maximize", "minimize"]


def _result(status: Status, **metrics: float) -> TrialResult:
    return TrialResult(
        status=status, metrics=Metrics(**metrics), reason=None if status is Status.OK else "why"
    )


@pytest.mark.parametrize(
    ("value", "status", "values", "constraints"),
    [
        (
            _result(Status.OK, throughput=100.0, step_time_ms=5.0),
            "ok",
            [100.0, 5.0],
            {"oom": 0.0, "diverged": 0.0, "numerics": 0.0},
        ),
        (
            _result(Status.OOM),
            "oom",
            [0.0, math.inf],
            {"oom": 1.0, "diverged": 0.0, "numerics": 0.0},
        ),
        (
            _result(Status.DIVERGED),
            "diverged",
            [0.0, math.inf],
            {"oom": 0.0, "diverged": 1.0, "numerics": 0.0},
        ),
        (_result(Status.ERROR), "error", None, {}),
        (_result(Status.OK, throughput=100.0), "error", None, {}),  # objective not measured
        (
            _result(Status.OK, throughput=1.0, step_time_ms=2.0).to_dict(),
            "ok",
            [1.0, 2.0],
            {"oom": 0.0, "diverged": 0.0, "numerics": 0.0},
        ),
        ([3.0, 4.0], "ok", [3.0, 4.0], {}),  # stock-style list
        ("fast", "error", None, {}),
        ([1.0], "error", None, {}),  # wrong length
        ([math.nan, 1.0], "error", None, {}),
    ],
)
def test_outcome_from_return(value, status, values, constraints):
    outcome = outcome_from_return(value, NAMES, DIRS)
    assert outcome.status == status
    assert outcome.values == values
    assert outcome.constraints == constraints
    assert outcome.user_attrs["status"] == status
    if status == "error":
        assert outcome.user_attrs.get("reason")


def test_outcome_stores_every_metric_flat():
    outcome = outcome_from_return(
        _result(Status.OK, throughput=7.0, step_time_ms=1.0, data_wait=3.5), NAMES, DIRS
    )
    assert outcome.user_attrs["data_wait"] == 3.5 and outcome.user_attrs["throughput"] == 7.0
    assert "power_w" in outcome.user_attrs  # None metrics are stored too: "not measurable here"


def test_plain_float_single_objective():
    outcome = outcome_from_return(2.5, ["throughput"], ["minimize"])
    assert outcome.values == [2.5] and outcome.plain and outcome.constraints == {}


# ---- search space ------------------------------------------------------------------------------

# A 2-core CPU without native bf16: the knob catalogue's rules call bf16 and tf32, pinned memory and
# more threads than cores poor there.
FACTS = {"device": "cpu", "cpus": 2, "bf16_native": False, "fp16_native": True, "tf32": False}


@pytest.mark.parametrize(
    ("params", "expected", "dropped", "removed"),
    [
        ({"precision": "choice(fp32,tf32,bf16)"}, {"precision": "choice(fp32)"}, 2, []),
        (
            {"loader.pin_memory": "choice(false,true)"},
            {"loader.pin_memory": "choice(false)"},
            1,
            [],
        ),
        ({"device.num_threads": "choice(1,2,4,8)"}, {"device.num_threads": "choice(1,2)"}, 2, []),
        (
            {"device.num_threads": "choice(4,8)"},
            {},
            2,
            ["device.num_threads"],
        ),  # nothing left: not searched
        ({"loader.batch_size": "choice(32,64)"}, {"loader.batch_size": "choice(32,64)"}, 0, []),
        (
            {"device.num_threads": "range(1,9)"},
            {"device.num_threads": "range(1,9)"},
            0,
            [],
        ),  # not a choice list
        ({"precision": "fp32"}, {"precision": "fp32"}, 0, []),
    ],
)
def test_drop_poor_choices(params, expected, dropped, removed):
    out = drop_poor_choices(params, lambda key, value: knobs.judge(key, value, FACTS))
    assert out.params == expected
    assert len(out.dropped) == dropped and out.removed_keys == removed
    assert all(reason for _, _, reason in out.dropped)


def test_preset_fixed_values_yield_to_command_line_keys():
    preset = {
        "measure.time_budget_s": "2.0",
        "measure.warmup_steps": "3",
        "loader.batch_size": "choice(32,64)",
    }
    assert preset_without_user_keys(preset, ["measure"]) == {"loader.batch_size": "choice(32,64)"}
    assert preset_without_user_keys(preset, ["measure.warmup_steps", "loader.batch_size"]) == {
        "measure.time_budget_s": "2.0",
        "loader.batch_size": "choice(32,64)",
    }
    assert preset_without_user_keys(preset, ["model"]) == preset


def test_device_params_follow_the_device_type():
    params = {"cpu": {"device.num_threads": "choice(1,2)"}}
    assert select_device_params(params, "cpu") == {"device.num_threads": "choice(1,2)"}
    assert select_device_params(params, "cuda") == {}


@pytest.mark.parametrize(
    "value",
    [
        32,
        1.5,
        1e-4,
        True,
        False,
        None,
        "fp32",
        "reduce-overhead",
        "off",
        "1",
        "true",
        "a b",
        "it's",
        "null",
    ],
)
def test_choice_text_reads_back_as_the_same_value(value):
    parsed = parser().parse_override(f"k={choice_text(value)}").value()
    assert parsed == value and type(parsed) is type(value)


def _config(**task):
    cfg = OmegaConf.create(
        {"hydra": {"runtime": {"choices": {"precision": "fp32", "model": "mlp"}}}, **task}
    )
    return cfg


def test_baseline_params_fit_the_space():
    cfg = _config(
        loader={"batch_size": 32, "pin_memory": False},
        device={"num_threads": None},
        optimizer={"lr": 0.001},
    )
    space = {
        "loader.batch_size": CategoricalDistribution([16, 32, 64]),
        "loader.pin_memory": CategoricalDistribution([False, True]),
        "precision": CategoricalDistribution(["fp32", "bf16"]),
        "device.num_threads": CategoricalDistribution([1, 2]),  # configured null: outside
        "optimizer.lr": FloatDistribution(1e-4, 1e-2, log=True),
    }
    fitting, outside = baseline_params(cfg, space)
    assert fitting == {
        "loader.batch_size": 32,
        "loader.pin_memory": False,
        "precision": "fp32",
        "optimizer.lr": 0.001,
    }
    assert outside == ["device.num_threads"]


@pytest.mark.parametrize(
    ("value", "distribution", "fits"),
    [
        (64, IntDistribution(32, 256, step=32), True),
        (48, IntDistribution(32, 256, step=32), False),
        (1, CategoricalDistribution([True, False]), False),  # 1 is not True
        (0.5, FloatDistribution(0.0, 1.0, step=0.25), True),
        (0.3, FloatDistribution(0.0, 1.0, step=0.25), False),
    ],
)
def test_baseline_fit_rules(value, distribution, fits):
    fitting, outside = baseline_params(_config(k=value), {"k": distribution})
    assert ("k" in fitting) is fits and ("k" in outside) is not fits


# ---- confirmation statistics --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [
        (0.975, 1, 12.706),
        (0.975, 2, 4.303),
        (0.975, 10, 2.228),
        (0.95, 5, 2.015),
        (0.975, 1e6, 1.960),
    ],
)
def test_t_quantile_matches_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-3)


def test_t_quantile_matches_scipy_for_fractional_df():
    stats = pytest.importorskip("scipy.stats")
    for df in (1.3, 2.7, 7.5):
        assert t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-7)


def test_speedup_estimate_and_interval():
    """Paired: entry i of each side is round i; the interval comes from the rounds' ratios
    (1.10, 1.12, 1.12 here; the unpaired data this test had, 1.10/1.23/1.12 by round, no longer
    excludes 1.0x at df=2)."""
    s = speedup([110.0, 121.0, 115.0], [100.0, 108.0, 103.0])
    geo = math.exp(
        sum(map(math.log, [110, 121, 115])) / 3 - sum(map(math.log, [100, 108, 103])) / 3
    )
    assert s.ratio == pytest.approx(geo) and s.n_pairs == 3 and s.verdict == "faster"
    assert s.ci_low < s.ratio < s.ci_high and s.distinguishable
    noisy = speedup([110.0, 90.0], [100.0, 105.0])
    assert noisy.ci_low < 1.0 < noisy.ci_high and noisy.distinguishable is False


def _confirmed(label, number, again):
    return ConfirmedConfig(label, number, {}, [], list(again))


def _record(*configs):
    return {"configs": [vars(c) for c in configs], **compare(configs, "maximize")}


def test_a_lucky_first_measurement_does_not_crown_a_candidate():
    """The winner's curse: the candidate was picked for its high sweep value; re-measured it ties
    the baseline, so the baseline stays the best (the CNN case in docs/benchmarks.md)."""
    record = _record(
        _confirmed("baseline", 0, [95.7, 95.6]),
        _confirmed("candidate1", 7, [94.5, 90.3]),
    )
    (entry,) = record["comparisons"]
    assert entry["n_candidate"] == 2 and entry["n_reference"] == 2  # the sweep value is left out
    assert entry["ratio"] < 1.0
    assert Confirmation.from_attr(record).winner == 0


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        ([(5, [150.0, 152.0])], 5),  # measurably faster
        ([(5, [130.0, 90.0])], 0),  # faster on average, but the CI includes 1.0x
        ([(5, [150.0, 152.0]), (6, [180.0, 181.0])], 6),  # the faster of two proven ones
        ([(5, [150.0, 152.0]), (6, [200.0, 120.0])], 5),  # a higher mean without proof loses
        ([(5, [120.0])], 5),  # one re-measurement each: no CI, the ratio decides
        ([(5, [])], 0),  # every re-measurement failed: never the winner
    ],
)
def test_confirmed_winner_must_be_measurably_faster_than_the_baseline(candidates, expected):
    base_again = [100.0, 101.0] if all(len(a) != 1 for _, a in candidates) else [100.0]
    configs = [_confirmed("baseline", 0, base_again)]
    configs += [_confirmed(f"candidate{i}", n, a) for i, (n, a) in enumerate(candidates, 1)]
    assert Confirmation.from_attr(_record(*configs)).winner == expected


def test_speedup_minimized_metric_is_inverted_and_single_points_have_no_ci():
    s = speedup([50.0], [100.0], direction="minimize")
    assert s.ratio == pytest.approx(2.0) and s.ci_low is None and s.distinguishable is None


@pytest.mark.parametrize(
    ("top_k", "rounds", "share", "n_trials", "n_cand", "expected"),
    [
        (2, 2, 0.25, 40, 5, confirm_schedule.ConfirmPlan(2, 2, 10)),  # first stage 6 runs <= 10
        (2, 4, 1.0, 10, 5, confirm_schedule.ConfirmPlan(1, 4, 10)),  # the defaults: one candidate
        (
            2,
            2,
            0.4,
            10,
            5,
            confirm_schedule.ConfirmPlan(1, 2, 4),
        ),  # two rounds beat a second candidate
        (
            2,
            3,
            0.6,
            10,
            5,
            confirm_schedule.ConfirmPlan(1, 3, 6),
        ),  # the first stage before candidates
        (2, 2, 0.25, 12, 5, None),  # 3 runs: no 2 pairs, no interval: off
        (2, 2, 0.25, 8, 5, None),  # 2 runs allowed
        (2, 0, 0.25, 40, 5, None),  # confirm.rounds=0
        (2, 2, 0.25, 40, 0, None),  # nothing to confirm
        (3, 2, 1.0, 4, 1, confirm_schedule.ConfirmPlan(1, 2, 4)),
        (1, 1, 1.0, 10, 1, confirm_schedule.ConfirmPlan(1, 2, 10)),  # an interval needs 2 rounds
    ],
)
def test_confirmation_plan_is_capped(top_k, rounds, share, n_trials, n_cand, expected):
    """(Since the two-stage stop: a plan needs 2 rounds, the first stage comes before a second
    candidate, and the plan carries the cap on all runs for the second stage.)"""
    plan = confirm_schedule.plan(top_k, rounds, share, n_trials, n_cand)
    assert plan == expected
    if plan:
        assert plan.runs <= plan.max_runs <= share * n_trials


# ---- export ------------------------------------------------------------------------------------


def test_overrides_to_experiment():
    body, skipped = overrides_to_experiment(
        [
            "precision=bf16",
            "loader.batch_size=128",
            "loader.pin_memory=true",
            "model=cnn",
            "model.width=64",
            "compile=off",
            "~cache.cpu_thp",
            "hydra.sweep.subdir=x",
        ],
        groups=["precision", "model", "compile", "loader"],
    )
    assert body["defaults"] == [
        {"override /precision": "bf16"},
        {"override /model": "cnn"},
        {"override /compile": "off"},
        "_self_",
    ]
    assert body["loader"] == {"batch_size": 128, "pin_memory": True}
    assert body["model"] == {"width": 64}
    assert skipped == ["~cache.cpu_thp", "hydra.sweep.subdir=x"]


def test_the_sweeps_measurement_settings_are_no_part_of_the_answer(tmp_path):
    """How gpuopt measured (a preset's short windows, a window's settings, the guard's global
    batch) is left out of best.yaml, the change to apply and the report's keys that
    differ: `+experiment=best` measures with the user's own settings."""
    from gpuopt.report.build import config_diff
    from gpuopt.study.experiment import override_diff
    from gpuopt.sweeper.open_study import SweepIdentity
    from gpuopt.sweeper.outputs import _experiment_overrides

    sweep = SweepIdentity("s", "sqlite://", tmp_path, ["throughput"], ["maximize"], "app", [])
    trial = ["loader.batch_size=64", "measure.time_budget_s=2.0", "guard.global_batch=32",
             "++measure.min_steps=10", "measure=quick", "+guard.x=1"]  # fmt: skip
    assert _experiment_overrides(trial, sweep) == (["loader.batch_size=64"], None)
    baseline = ["loader.batch_size=32", "measure.time_budget_s=2.0", "guard.global_batch=32"]
    assert override_diff(baseline, trial) == (["loader.batch_size=64"], [])
    base_conf = {"loader": {"batch_size": 32}, "measure": {"min_steps": 5}}
    best_conf = {"loader": {"batch_size": 64}, "measure": {"min_steps": 10}}
    assert [c.key for c in config_diff(base_conf, best_conf)] == ["loader.batch_size"]


# ---- hardware ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "line"),
    [
        ({}, "unset CUDA_VISIBLE_DEVICES"),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, "export CUDA_VISIBLE_DEVICES=2,3"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}, "export CUDA_VISIBLE_DEVICES=GPU-1a2b"),
        ({"CUDA_VISIBLE_DEVICES": ""}, "export CUDA_VISIBLE_DEVICES=''"),
    ],
)
def test_gpu_setup_command(environ, line):
    assert hardware.gpu_setup_command(environ) == line


def test_fingerprint_is_stable_and_names_the_hardware():
    cpu = {"machine": "x86_64", "system": "Linux", "cpu": "AMD EPYC", "cpu_count": 2, "gpus": []}
    gpu = {**cpu, "gpus": ["NVIDIA H200"]}
    assert hardware.hardware_id(cpu) == hardware.hardware_id(dict(cpu))
    assert hardware.hardware_id(cpu).startswith("cpu2-")
    assert hardware.hardware_id(gpu).startswith("h200-") and hardware.hardware_id(
        gpu
    ) != hardware.hardware_id(cpu)
    assert hardware.default_study_name("mlp", "default", "cpu2-abc") == "mlp-default-cpu2-abc"


def test_default_storage_is_the_output_dirs_gpuopt_db(tmp_path, monkeypatch):
    """The one default-storage rule (gpuopt/study/storage.py), as gpuopt's conf/config.yaml sets
    it: <GPUOPT_OUTPUT_DIR, else outputs>/gpuopt.db. (It replaces sweeper/machine.py's unused
    default_storage, whose test this was.)"""
    monkeypatch.setenv("GPUOPT_OUTPUT_DIR", str(tmp_path / "out"))
    assert storage.default_url() == f"sqlite:///{tmp_path / 'out' / 'gpuopt.db'}"
    monkeypatch.delenv("GPUOPT_OUTPUT_DIR")
    assert storage.default_url() == "sqlite:///outputs/gpuopt.db"
    assert not (tmp_path / "out").exists()  # finding the study creates nothing


def test_probe_env_failure_is_reported_not_raised_nor_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(tmp_path))
    probe = hardware.probe_env(python=sys.executable + "-does-not-exist")
    assert probe.error and probe.data == {}  # no facts: nothing judged poor
    assert not (tmp_path / hardware.PROBE_FILE).exists()


def test_the_env_probe_is_kept_per_machine_interpreter_and_visible_gpus(monkeypatch, tmp_path):
    """A second sweep on the same machine reads the kept probe (no subprocess importing torch);
    other visible GPUs are another key, so they are probed afresh."""
    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ran = []
    real_run = subprocess.run
    monkeypatch.setattr(
        hardware.subprocess, "run", lambda *a, **k: ran.append(a[0]) or real_run(*a, **k)
    )
    first = hardware.probe_env()
    assert not first.error and first.data["device"] == "cpu" and len(ran) == 1
    assert hardware.probe_env().data == first.data and len(ran) == 1  # kept
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.probe_env().data["device"] == "cpu" and len(ran) == 2  # another key
    kept = json.loads((tmp_path / hardware.PROBE_FILE).read_text())
    assert len(kept) == 2 and all(json.loads(k)["python"] == sys.executable for k in kept)
    # the least recently made probe goes first once PROBE_KEEP are kept
    monkeypatch.setattr(hardware, "PROBE_KEEP", 2)
    oldest = min(kept, key=lambda k: kept[k]["made"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    hardware.probe_env()
    now_kept = json.loads((tmp_path / hardware.PROBE_FILE).read_text())
    assert len(now_kept) == 2 and oldest not in now_kept and len(ran) == 3


def test_the_env_probe_runs_only_where_it_can_judge_a_searched_key(monkeypatch):
    from gpuopt.sweeper import task
    from gpuopt.sweeper.options import SweeperOptions

    calls = []
    monkeypatch.setattr(
        hardware, "probe_env", lambda *a, **k: calls.append(1) or hardware.EnvProbe()
    )
    task.probe_env(SweeperOptions(), {"x": "range(-5, 5)", "model.width": "choice(8,16)"})
    assert calls == []  # an app's own keys: nothing to trim, no subprocess importing torch
    task.probe_env(SweeperOptions(), {"x": "range(-5, 5)", "+loader.batch_size": "choice(8,16)"})
    assert calls == [1]
    task.probe_env(SweeperOptions(device_params={"cuda": {"model.width": "choice(8)"}}), {})
    assert calls == [1, 1]  # device params need the device type
    task.probe_env(SweeperOptions(device_aware=False), {"precision": "choice(fp32,bf16)"})
    assert calls == [1, 1]


def test_every_key_the_env_probe_can_judge_is_one_the_sweeper_asks_it_for():
    from gpuopt.trial.devices import detect_capabilities

    names = [row["key"] for row in knobs.poor_rows(detect_capabilities("cpu"))]
    names += [k.group for k in knobs.KNOBS if k.poor and k.group]
    assert names and all(knobs.probed(name) for name in names)


# ---- resume ------------------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_owner_alive():
    me = owners.this_owner()
    assert owners.owner_alive(me) is True
    assert owners.owner_alive({**me, "pid": _dead_pid()}) is False
    assert owners.owner_alive({**me, "start": (me["start"] or 0) + 12345}) is False  # pid reused
    assert owners.owner_alive({**me, "host": "elsewhere"}) is None


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_zombie_is_dead_to_the_watchdog_and_to_resume():
    """One liveness check (lifeline.process_alive) for a trial's sweep and for a trial's owner: a
    process that exited but is not reaped yet (a zombie, which kill(pid, 0) still finds) is dead."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        start = lifeline.start_ticks(proc.pid)
        deadline = time.monotonic() + 30
        while _proc_state(proc.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _proc_state(proc.pid) == "Z"
        assert lifeline.process_alive(proc.pid, start) is False
        assert lifeline.process_alive(proc.pid, None) is False
        owner = {**owners.this_owner(), "pid": proc.pid, "start": start}
        assert owners.owner_alive(owner) is False
        gone = lifeline.SweepProcess(proc.pid, start, -1)
        assert "ended" in lifeline.watchdog_verdict(gone, deadline=1e18, now=0.0)
    finally:
        proc.wait()
    me = owners.this_owner()
    assert lifeline.process_alive(me["pid"], me["start"])
    assert lifeline.process_alive(me["pid"], None)


def test_running_elsewhere_is_other_live_workers_trials():
    """The trials that keep this worker from being the last one (the confirmation waits for
    them): RUNNING, not this worker's, and not under an owner known dead."""
    study = optuna.create_study()
    me = owners.this_owner()
    by_name = {
        "mine": me,
        "dead": {**me, "pid": _dead_pid()},
        "other host": {**me, "host": "elsewhere"},  # alive until its heartbeat goes stale
        "ownerless": None,  # asked a moment ago: its owner is on its way
    }
    for owner in by_name.values():
        trial = study.ask()
        if owner is not None:
            study._storage.set_trial_system_attr(trial._trial_id, resume.ATTR_OWNER, owner)
    finished = study.ask()
    study._storage.set_trial_system_attr(finished._trial_id, resume.ATTR_OWNER, me)
    study.tell(finished, 1.0)
    found = owners.running_elsewhere(study.get_trials(deepcopy=False))
    assert [t.number for t in found] == [2, 3]  # the other host's and the ownerless one


def test_recover_interrupted_fails_and_reenqueues():
    study = optuna.create_study(directions=["maximize"])
    dead = {**owners.this_owner(), "pid": _dead_pid()}
    study.add_trial(
        create_trial(
            state=TrialState.COMPLETE,
            values=[1.0],
            params={"x": 1},
            distributions={"x": CategoricalDistribution([1, 2])},
        )
    )
    running = study.ask()
    running.suggest_categorical("x", [1, 2])
    running.set_user_attr(ATTR_BASELINE, True)
    study._storage.set_trial_system_attr(running._trial_id, resume.ATTR_OWNER, dead)
    alive = study.ask()  # owned by this (living) process: in flight, left alone
    study._storage.set_trial_system_attr(alive._trial_id, resume.ATTR_OWNER, owners.this_owner())

    assert owners.trials_to_go(study.get_trials(), 4) == 2  # complete + the live running one
    assert resume.recover_interrupted(study) == [running.number]
    trials = study.get_trials()
    failed = trials[running.number]
    assert failed.state == TrialState.FAIL and failed.user_attrs["interrupted"] is True
    assert "interrupted" in failed.user_attrs["reason"]
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    assert len(waiting) == 1 and waiting[0].user_attrs == {
        "rerun_of": running.number,
        ATTR_BASELINE: True,
    }
    assert owners.trials_to_go(trials, 4) == 2  # the interrupted one no longer counts
    assert owners.has_baseline(trials)


def test_single_objective_samplers_are_refused_for_several_objectives():
    from gpuopt.sweeper.task import check_sampler

    sampler = optuna.samplers.CmaEsSampler()
    check_sampler(sampler, ["maximize"])
    with pytest.raises(SweepConfigError, match="cmaes"):
        check_sampler(sampler, ["maximize", "maximize"])


@pytest.mark.parametrize("storage", ["sqlite", "memory"])
def test_user_attrs_written_in_one_go_with_secrets_masked(tmp_path, storage):
    from gpuopt.sweeper.record import trial_attrs

    url = f"sqlite:///{tmp_path / 'a.db'}" if storage == "sqlite" else None
    study = optuna.create_study(storage=url)
    trial = study.ask()
    attrs = {"status": "ok", "throughput": 1.5, "overrides": ["a=1"], "env": {"device": "cpu"}}
    reason = "could not reach postgresql://u:s3cretpw@db/x"
    trial_attrs(study, trial, {**attrs, "reason": reason})
    study.tell(trial, 1.0)
    written = study.trials[0].user_attrs
    assert {k: written[k] for k in attrs} == attrs
    assert "s3cretpw" not in written["reason"] and "db/x" in written["reason"]


@pytest.mark.parametrize("preset", ["default", "loader", "precision", "compile", "cache", "full"])
def test_every_search_preset_composes_and_names_real_keys(preset):
    """A preset whose params name a missing key or group option would fail only at sweep time."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from gpuopt.core.spec import register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_module("gpuopt.conf"):
        cfg = compose("config", overrides=[f"search={preset}"], return_hydra_config=True)
        params = dict(cfg.hydra.sweeper.params)
        params.update(
            {k: v for space in cfg.hydra.sweeper.device_params.values() for k, v in space.items()}
        )
        assert params, f"search={preset} searches nothing"
        groups = cfg.hydra.runtime.choices
        for key, value in params.items():
            if key in groups:  # a group: every option must compose
                options = str(value)[len("choice(") : -1].split(",")
                for option in options:
                    compose("config", overrides=[f"search={preset}", f"{key}={option.strip()}"])
            else:
                assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", key


def test_default_sampler_is_multivariate_tpe_and_other_samplers_replace_it():
    """gpuopt's default changes one stock TPE key; choosing another sampler must not inherit it
    (a leftover `multivariate` key would fail RandomSampler's schema)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from gpuopt.core.spec import register_schemas
    from gpuopt.sweeper.plugin import SAMPLER_WHITELIST

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_module("gpuopt.conf"):
        default = compose("config", return_hydra_config=True).hydra.sweeper.sampler
        stock = compose(
            "config", overrides=["hydra/sweeper/sampler=tpe"], return_hydra_config=True
        ).hydra.sweeper.sampler
        chosen = compose(
            "config", overrides=["hydra/sweeper/sampler=random"], return_hydra_config=True
        ).hydra.sweeper.sampler
    sampler = instantiate(default, _execution_whitelist_=SAMPLER_WHITELIST)
    assert isinstance(sampler, optuna.samplers.TPESampler) and sampler._multivariate
    assert sampler._constant_liar  # a screen or an n_jobs batch is asked before it is told
    assert stock.multivariate is False
    assert chosen._target_ == "optuna.samplers.RandomSampler" and "multivariate" not in chosen


# ---- sweeper options: one default each, validated once ------------------------------------------


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"n_trials": 0}, "hydra.sweeper.n_trials"),
        ({"n_trials": 2.5}, "hydra.sweeper.n_trials"),
        ({"n_jobs": 0}, "hydra.sweeper.n_jobs"),
        ({"max_failure_rate": -0.1}, "hydra.sweeper.max_failure_rate"),
        ({"max_failure_rate": 1.5}, "hydra.sweeper.max_failure_rate"),
        ({"confirm": {"rounds": -1}}, "hydra.sweeper.confirm.rounds"),
        ({"confirm": {"top_k": 0}}, "hydra.sweeper.confirm.top_k"),
        ({"confirm": {"max_share": 0.0}}, "hydra.sweeper.confirm.max_share"),
        ({"confirm": {"max_share": 4.5}}, "hydra.sweeper.confirm.max_share"),
        ({"confirm": {"target_halfwidth": 0.0}}, "hydra.sweeper.confirm.target_halfwidth"),
        ({"confirm": {"shares": 0.5}}, "hydra.sweeper.confirm.shares"),
        ({"heartbeat_interval": -5}, "hydra.sweeper.heartbeat_interval"),
        ({"grace_period": 0}, "hydra.sweeper.grace_period"),
        ({"env_timeout_s": 0}, "hydra.sweeper.env_timeout_s"),
    ],
)
def test_bad_sweeper_options_are_one_line_errors(settings, key):
    from gpuopt.sweeper.options import SweeperOptions

    with pytest.raises(SweepConfigError) as info:
        SweeperOptions.build(**settings)
    assert info.value.key == key and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"n_trials": 1, "n_jobs": 4, "max_failure_rate": 0.0},
        {"max_failure_rate": 1.0, "confirm": {"rounds": 0, "max_share": 1.0}},
        {"heartbeat_interval": None, "grace_period": None},  # null: off / 2 x interval
        {"heartbeat_interval": 0},  # 0: off
        {"heartbeat_interval": 5, "grace_period": 30},
    ],
)
def test_good_sweeper_options_build(settings):
    """Every setting given is kept, every other one is its default (nothing given: the defaults;
    `baseline: null` becomes off: gpuopt does not measure this app, no objectives of its own)."""
    import dataclasses

    from gpuopt.sweeper.options import SweeperOptions

    options = SweeperOptions.build(**settings)
    defaults = SweeperOptions()
    given = {k: v for k, v in settings.items() if k != "confirm"}
    confirm = dataclasses.replace(defaults.confirm, **settings.get("confirm", {}))
    assert vars(options) == {**vars(defaults), "baseline": False, **given, "confirm": confirm}


def test_sweeper_options_have_one_default_each():
    """The composed hydra.sweeper node (plugin.py's ConfigStore) and SweeperOptions() agree on
    every setting; the documented confirm.max_share is 1.0, target_halfwidth 0.05."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from gpuopt.core.spec import register_schemas
    from gpuopt.sweeper.options import SweeperOptions

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_module("gpuopt.conf"):
        node = compose("config", overrides=["~search"], return_hydra_config=True).hydra.sweeper
    settings = {
        k: v for k, v in OmegaConf.to_container(node).items() if k not in ("sampler", "_target_")
    }
    composed = SweeperOptions.build(**settings)
    defaults = SweeperOptions()
    assert defaults.confirm.max_share == 1.0 and defaults.confirm.target_halfwidth == 0.05
    assert composed.confirm == defaults.confirm
    for key in ("n_trials", "n_jobs", "max_failure_rate", "device_aware"):
        assert getattr(composed, key) == getattr(defaults, key), key
    for key in ("env_timeout_s", "heartbeat_interval", "grace_period", "study_name"):
        assert getattr(composed, key) == getattr(defaults, key), key
    # The sweeper's own defaults are the stock ones (an in-memory study; the baseline only where
    # gpuopt measures the objectives); gpuopt's conf/config.yaml sets exactly these three.
    assert (defaults.storage, defaults.baseline, defaults.gpuopt_task) == (None, None, False)
    assert SweeperOptions.build().baseline is False  # a stock app's objective: its own value
    assert SweeperOptions.build(objectives=["throughput"]).baseline is True
    assert SweeperOptions.build(objectives=["throughput"], baseline=False).baseline is False
    assert composed.baseline is True and composed.gpuopt_task is True
    assert composed.storage == "${gpuopt.sqlite:${output_dir}/gpuopt.db}"


def test_only_the_baseline_of_gpuopts_own_task_is_launched_profiled():
    from types import SimpleNamespace

    from gpuopt.sweeper import profile_runs
    from gpuopt.sweeper.options import SweeperOptions

    trials = [SimpleNamespace(user_attrs={"baseline": True}), SimpleNamespace(user_attrs={})]
    overrides = [["a=1"], ["a=2"]]
    own = SweeperOptions.build(n_trials=4, gpuopt_task=True)
    assert profile_runs.launch_overrides(own, trials, overrides) == [["a=1", "profile=on"], ["a=2"]]
    assert overrides == [["a=1"], ["a=2"]]  # what the trials record stays as it was
    stock = SweeperOptions.build(n_trials=4)  # another app: it has no `profile` group
    assert profile_runs.launch_overrides(stock, trials, overrides) == overrides
    off = SweeperOptions.build(n_trials=4, gpuopt_task=True, profile=False)
    assert profile_runs.launch_overrides(off, trials, overrides) == overrides


# ---- custom_search_space under Hydra's execution whitelist ---------------------------------------


def test_custom_search_space_trusts_the_apps_own_module_without_a_warning(tmp_path, monkeypatch):
    """A script's function (Hydra's `_locate` imports the script under its file name) is trusted:
    no Hydra 1.4 deprecation warning; one outside the app keeps the stock, warned call."""
    import warnings

    from gpuopt.sweeper import space as custom_space

    (tmp_path / "my-app.py").write_text("def configure(cfg, trial):\n    return 'called'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main = type(sys)("__main__")
    main.__file__ = str(tmp_path / "my-app.py")
    main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", main)

    def task(cfg):  # the app's task function, defined in its script
        return 0.0

    task.__module__ = "__main__"
    assert custom_space.app_modules(task) == ["my-app.*"]
    # Hydra's own deprecation raised, not said once per process (gpuopt.hydra_interop): a call
    # on Hydra's legacy, unwhitelisted path fails here whatever ran before in this process.
    monkeypatch.setenv("HYDRA_DEPRECATION_WARNINGS_AS_ERRORS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extend = custom_space.extender("my-app.configure", task)
    assert extend(None, None) == "called"
    with pytest.raises(HydraDeprecationError, match="_execution_whitelist_"):
        custom_space.extender("json.dumps", task)  # not the app's: the stock call
    assert custom_space.app_modules(custom_space.extender) == [
        "gpuopt.sweeper.space.*",
        "gpuopt.sweeper.*",
    ]
    assert custom_space.extender(None, task) is None


def test_the_stale_check_runs_at_once_then_at_most_every_half_interval(monkeypatch):
    """The storage's stale-trial query runs at the sweep's start and then only when due: not
    before every trial of a fast sweep (it finds nothing a grace period has not made stale)."""
    import optuna

    from gpuopt.sweeper import resume

    now, asked = [0.0], []
    monkeypatch.setattr(resume, "fail_stale", lambda s, t=None: asked.append(now[0]) or [])
    study, recovery = optuna.create_study(), resume.Recovery(60, 30.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 29.0, 30.0, 31.0, 61.0):
        now[0] = t
        recovery.recover(study, [])
    assert asked == [0.0, 30.0, 61.0]
