"""run_trial end to end on CPU with tiny sizes: real models, real DataLoader workers, real failures."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import time

import pytest
import torch
from omegaconf import open_dict

from gpuopt.config import ConfigError, validate
from gpuopt.engines import run_trial
from gpuopt.engines._common import CeilingReplay
from gpuopt.env import check_device_support
from gpuopt.result import Metrics, Status
from tests.conftest import TINY_TRIAL

FAMILIES = {
    "mlp": ["model=mlp", "model.width=16", "model.depth=1", "model.input_shape=[12]"],
    "cnn": ["model=cnn", "model.width=4", "model.depth=1", "model.input_shape=[3,8,8]"],
    "transformer": ["model=transformer", "model.width=16", "model.depth=1", "model.heads=2",
                    "model.input_shape=[8]", "model.num_classes=32"],
}  # fmt: skip


def _run(compose_cfg, *overrides, inspect=None, edit=None):
    cfg = compose_cfg(*TINY_TRIAL, *overrides)
    if edit is not None:
        with open_dict(cfg):
            edit(cfg)
    spec = validate(cfg)
    device, warnings = check_device_support(spec)
    result = run_trial(spec, device=device, inspect=inspect)
    result.warnings[:0] = warnings
    return result


def _assert_measured(result, max_steps=6):
    m = result.metrics
    assert result.status is Status.OK, result.reason
    assert 2 <= m.timed_steps <= max_steps
    assert m.stop_reason in ("stable", "budget", "max_steps")
    assert m.throughput > 0 and m.ceiling_throughput > 0
    # Throughput is samples over the window's wall time, and the step times tile that window.
    assert m.throughput == pytest.approx(m.timed_steps * 8 / m.timed_seconds)
    assert m.step_time_p10_ms <= m.step_time_ms <= m.step_time_p90_ms
    assert 0 <= m.data_wait <= 100 and m.utilization == pytest.approx(100 - m.data_wait)
    assert m.input_efficiency == pytest.approx(100 * m.throughput / m.ceiling_throughput)
    assert m.flops_per_sample > 0 and m.mfu is None  # no documented peak for a CPU
    assert m.peak_memory_mb >= 0 and m.startup_time_s > 0 and m.warmup_time_s > 0
    assert m.compile_time_s == 0.0
    assert m.power_w is None and m.energy_per_sample_j is None  # no NVML on CPU
    assert result.env["device"] == "cpu" and result.env["torch"] == torch.__version__


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_model_family_trains_and_is_measured(compose_cfg, family):
    built = {}
    result = _run(compose_cfg, *FAMILIES[family], inspect=built.__setitem__)
    _assert_measured(result)
    expected = {"mlp": "MLP", "cnn": "CNN", "transformer": "GPT"}[family]
    assert type(built["model"]).__name__ == expected
    assert result.config["model"]["_target_"].endswith(expected)


def test_mlp_flops_match_the_matmul_count(compose_cfg):
    # Linear layers 12->16, 16->16, 16->10: forward 2*sum(in*out) per sample; backward computes the
    # weight gradients (same count) and input gradients for every layer but the first.
    result = _run(compose_cfg, *FAMILIES["mlp"])
    layers = [(12, 16), (16, 16), (16, 10)]
    forward = 2 * sum(i * o for i, o in layers)
    backward = forward + 2 * sum(i * o for i, o in layers[1:])
    assert result.metrics.flops_per_sample == forward + backward


@pytest.mark.parametrize(
    ("mode", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
)
def test_each_cpu_precision_runs_with_its_autocast_and_scaler(compose_cfg, mode, dtype):
    built = {}
    result = _run(compose_cfg, *FAMILIES["mlp"], f"precision={mode}", inspect=built.__setitem__)
    assert result.status is Status.OK, result.reason
    workload = built["workload"]
    with workload.precision.autocast():
        out = workload.model(torch.zeros(2, 12))
    assert out.dtype == dtype
    assert (workload.precision.scaler is not None) == (mode == "fp16")


def test_tf32_on_cpu_is_a_config_error_naming_precision_mode(compose_cfg):
    spec = validate(compose_cfg(*TINY_TRIAL, "precision=tf32"))
    with pytest.raises(ConfigError) as info:
        check_device_support(spec)
    assert (info.value.key, info.value.value) == ("precision.mode", "tf32")
    assert "compute capability >= 8.0" in str(info.value)


def test_loader_knobs_reach_a_real_dataloader_with_worker_processes(compose_cfg, tmp_path):
    def use_pid_dataset(cfg):
        cfg.data = {"_target_": "tests.helpers.user_models.PidRecordingDataset", "pid_dir": str(tmp_path),
                    "features": 12, "classes": 10, "size": 64}  # fmt: skip

    built = {}
    result = _run(
        compose_cfg, *FAMILIES["mlp"], "trust=[tests.*]", "loader.num_workers=2", "loader.prefetch_factor=3",
        "loader.persistent_workers=true", "loader.pin_memory=true", "loader.drop_last=false",
        inspect=built.__setitem__, edit=use_pid_dataset,
    )  # fmt: skip
    assert result.status is Status.OK, result.reason
    loader = built["loader"]
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
    assert (loader.batch_size, loader.drop_last) == (8, False)
    assert loader.pin_memory is False  # no accelerator: pinning is a no-op, and we say so
    assert any("pin_memory" in w for w in result.warnings)
    producers = [name.split("-") for name in os.listdir(tmp_path)]
    worker_pids = {int(pid) for pid, worker in producers if worker != "main"}
    assert worker_pids and os.getpid() not in worker_pids
    assert {worker for _, worker in producers} == {"0", "1"}


def test_prefetch_without_workers_is_ignored_with_a_warning(compose_cfg):
    built = {}
    result = _run(
        compose_cfg, *FAMILIES["mlp"], "loader.prefetch_factor=4", inspect=built.__setitem__
    )
    assert result.status is Status.OK and built["loader"].num_workers == 0
    assert any("prefetch_factor" in w and "ignored" in w for w in result.warnings)


def _user_model(target, **kwargs):
    def edit(cfg):
        cfg.model = {"_target_": f"tests.helpers.user_models.{target}", "input": "vectors",
                     "input_shape": [12], "num_classes": 3, "features": 12, "classes": 3, **kwargs}  # fmt: skip

    return edit


def test_user_model_by_target_is_trained_with_its_own_arguments(compose_cfg):
    built = {}
    result = _run(
        compose_cfg,
        "trust=[tests.*]",
        inspect=built.__setitem__,
        edit=_user_model("TinyNet", hidden=5),
    )
    _assert_measured(result)
    assert type(built["model"]).__name__ == "TinyNet" and built["model"].hidden == 5
    # The sweeper receives the result across processes (submitit pickles it).
    assert pickle.loads(pickle.dumps(result)) == result


def test_nan_loss_is_a_diverged_result(compose_cfg):
    result = _run(compose_cfg, "trust=[tests.*]", edit=_user_model("NaNNet"))
    assert result.status is Status.DIVERGED
    assert "NaN" in result.reason and "warm-up" in result.reason


def test_exploding_learning_rate_diverges(compose_cfg):
    result = _run(compose_cfg, *FAMILIES["mlp"], "optimizer=sgd", "optimizer.lr=1e30")
    assert result.status is Status.DIVERGED


def test_exception_in_user_model_is_an_error_result_with_type_and_message(compose_cfg):
    result = _run(compose_cfg, "trust=[tests.*]", edit=_user_model("BrokenNet"))
    assert result.status is Status.ERROR
    assert result.reason == "ValueError: user model bug: shapes do not line up"


def test_real_cpu_out_of_memory_is_an_oom_result_and_the_next_trial_runs(compose_cfg):
    # A 10^9-wide layer asks the CPU allocator for ~10^12 bytes: it refuses for real.
    result = _run(compose_cfg, *FAMILIES["mlp"], "model.width=1000000000")
    assert result.status is Status.OOM
    assert "can't allocate memory" in result.reason
    assert result.metrics.throughput is None  # nothing measured is reported as null, not zero
    _assert_measured(_run(compose_cfg, *FAMILIES["mlp"]))


def test_num_threads_applies_and_null_restores_the_default():
    from gpuopt.policies import set_num_threads

    set_num_threads(None)
    default = torch.get_num_threads()
    set_num_threads(1)
    assert torch.get_num_threads() == 1
    set_num_threads(None)  # a later trial in the same process without a setting
    assert torch.get_num_threads() == default


def test_ceiling_replay_both_engines_drive_is_bounded_by_steps_and_by_time():
    """CeilingReplay (the one ceiling both engines use): warm-up untimed, at most max_steps timed,
    or fewer once the budget passed, never under its minimum of timed steps."""
    cpu = torch.device("cpu")
    calls = []
    replay = CeilingReplay(cpu, max_steps=7, budget_s=10.0, warmup_steps=1)
    replay.run(lambda: calls.append(1) or 8)
    assert (len(calls), replay.steps, replay.samples) == (8, 7, 56) and replay.seconds < 10.0
    slow = CeilingReplay(cpu, max_steps=1000, budget_s=0.05, warmup_steps=0)
    slow.run(lambda: time.sleep(0.02) or 8)
    assert 3 <= slow.steps < 1000 and slow.seconds >= 0.05
    m = Metrics(throughput=slow.samples / slow.seconds / 2)
    slow.record(m)
    assert m.ceiling_throughput == pytest.approx(slow.samples / slow.seconds)
    assert m.input_efficiency == pytest.approx(50.0)
    # A framework's batch-end hook drives the same object step by step.
    hooked = CeilingReplay(cpu, max_steps=2, budget_s=10.0, warmup_steps=1)
    hooked.begin()
    assert [hooked.step_done(4) for _ in range(3)] == [False, False, True]
    assert (hooked.steps, hooked.samples) == (2, 8)


def test_engine_without_its_extra_is_an_error_result_before_anything_is_built(
    compose_cfg, monkeypatch
):
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("validating engine=lightning needs the extra installed")
    spec = validate(compose_cfg(*TINY_TRIAL, "engine=lightning"))  # validated while installed
    monkeypatch.setitem(sys.modules, "lightning", None)  # then as if it never was
    built = {}
    result = run_trial(spec, inspect=built.__setitem__)
    assert result.status is Status.ERROR and built == {}
    assert result.reason == (
        'ModuleNotFoundError: engine=lightning needs lightning: pip install "gpuopt[lightning]"'
    )


# -- steady state, the measured peak, the machine's limit (issue 15) -------------------------------
def test_the_window_never_restarts_the_loader_even_on_a_dataset_shorter_than_it(
    compose_cfg, monkeypatch
):
    # 16 samples = 2 batches per epoch, the trial draws up to 1 + 1 + 6 batches: one epoch that
    # cycles over the data, and one more iterator after the window (the measured boundary).
    from torch.utils.data import DataLoader

    iterators: dict[int, int] = {}
    real_iter = DataLoader.__iter__

    def counting_iter(self):
        iterators[id(self)] = iterators.get(id(self), 0) + 1
        return real_iter(self)

    monkeypatch.setattr(DataLoader, "__iter__", counting_iter)
    built = {}
    result = _run(compose_cfg, *FAMILIES["mlp"], "data.size=16", inspect=built.__setitem__)
    _assert_measured(result)
    assert iterators[id(built["loader"])] == 2
    assert result.metrics.epoch_steps == 2  # the real epoch: 16 samples / batch 8


@pytest.mark.parametrize("workers", [0, 1])
def test_epoch_overhead_is_measured_apart_and_amortized_over_the_real_epoch(compose_cfg, workers):
    result = _run(compose_cfg, *FAMILIES["mlp"], f"loader.num_workers={workers}")
    m = result.metrics
    _assert_measured(result)
    assert m.epoch_steps == 64 // 8 and m.epoch_overhead_s >= 0
    if workers:
        assert m.epoch_overhead_s > 0  # a fresh epoch starts a worker process
    step_s = m.timed_seconds / m.timed_steps
    epoch_s = m.epoch_steps * step_s
    assert m.throughput_amortized == pytest.approx(
        m.throughput * epoch_s / (epoch_s + m.epoch_overhead_s)
    )
    assert m.throughput_amortized <= m.throughput


def test_data_epoch_steps_sets_the_epoch_amortized_over_and_is_not_a_dataset_argument(
    compose_cfg,
):
    result = _run(compose_cfg, *FAMILIES["mlp"], "data.epoch_steps=1000")
    assert result.status is Status.OK, result.reason
    assert result.metrics.epoch_steps == 1000
    with pytest.raises(ConfigError, match=r"data\.epoch_steps"):
        validate(compose_cfg(*TINY_TRIAL, "data.epoch_steps=0"))


def test_cpu_trial_reports_mfu_against_the_probe_and_its_limit(compose_cfg, monkeypatch, tmp_path):
    from gpuopt.env import usable_cpus

    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(tmp_path))
    result = _run(compose_cfg, *FAMILIES["mlp"])
    m = result.metrics
    _assert_measured(result)
    # No documented CPU peak (mfu null), but the measured one gives a utilization of the math.
    assert m.mfu is None and m.hfu is None and m.peak_flops_measured > 0
    assert m.mfu_achievable == pytest.approx(
        100 * m.flops_per_sample * m.throughput / m.peak_flops_measured
    )
    assert (tmp_path / "peak_flops.json").exists()
    assert m.hardware_flops_per_sample == m.flops_per_sample  # no checkpointing
    # The limit: the usable cores shared by the loader's and the compute's cost per sample.
    assert m.loader_cost_us > 0 and m.compute_cost_us > 0 and m.limit_bound == "cores"
    per_sample_s = (m.loader_cost_us + m.compute_cost_us) / 1e6
    assert m.limit_throughput == pytest.approx(usable_cpus() / per_sample_s)
    assert m.limit_efficiency == pytest.approx(100 * m.throughput / m.limit_throughput)


def test_checkpointed_model_reports_model_and_hardware_flops_apart(compose_cfg):
    result = _run(compose_cfg, *FAMILIES["mlp"], "model.activation_checkpointing=true")
    m = result.metrics
    assert result.status is Status.OK, result.reason
    # One 16x16 block recomputed per sample in the backward: 2*16*16 FLOPs more on the hardware.
    assert m.hardware_flops_per_sample - m.flops_per_sample == 2 * 16 * 16


def test_measurements_beside_the_window_can_be_turned_off(compose_cfg):
    result = _run(
        compose_cfg, *FAMILIES["mlp"], "measure.peak_probe=false", "measure.loader_cost=false"
    )
    m = result.metrics
    assert m.mfu_achievable is None and m.peak_flops_measured is None
    assert m.loader_cost_us is None and m.limit_throughput is None
    assert m.throughput_amortized is not None  # the epoch boundary is always priced
