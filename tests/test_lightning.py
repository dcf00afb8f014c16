"""The Lightning engine (engine=lightning): built-in families and a user's LightningModule run through
lightning.Trainer, measured like the native engine; precision mapping; the missing-extra message;
failures classified as oom/diverged/error."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from gpuopt.core.errors import ConfigError
from gpuopt.core.result import Status
from gpuopt.core.spec import PrecisionConf
from gpuopt.trial.context import Trial
from gpuopt.trial.measure import measure_step_flops
from gpuopt.trial.prepare import load_spec
from tests.conftest import TINY_TRIAL, assert_cpu_peak, compose_config
from tests.helpers.lightning_specs import user_spec as _user_spec

pytest.importorskip("lightning")

from gpuopt.engines._ceiling import CEILING_WARMUP_STEPS
from gpuopt.engines._meter import WindowMeter
from gpuopt.engines.lightning.engine import BuiltinModule
from gpuopt.engines.lightning.meter import FetchTimer, MeasureCallback, lightning_precision
from gpuopt.engines.registry import run_trial

HELPERS = "tests.helpers.lightning_models"
TINY_MODELS = {
    "mlp": ["model=mlp", "model.width=32", "model.depth=1", "model.input_shape=[16]"],
    "cnn": ["model=cnn", "model.width=4", "model.depth=1", "model.input_shape=[3,8,8]"],
    "transformer": [
        "model=transformer", "model.width=16", "model.depth=1", "model.heads=2",
        "model.input_shape=[8]", "model.num_classes=32",
    ],
}  # fmt: skip


class Seen:
    """Collects what the engine built (the `inspect` hook of run_trial), and the dtypes the
    wrapped model's forward returned."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.output_dtypes: set[torch.dtype] = set()
        self.matmul_precision: str | None = None

    def __call__(self, name: str, obj: Any) -> None:
        self.objects[name] = obj
        if name == "module":  # built after the precision policy is applied
            self.matmul_precision = torch.get_float32_matmul_precision()
        if name == "module" and isinstance(obj, BuiltinModule):
            obj.model.register_forward_hook(lambda _m, _i, out: self.output_dtypes.add(out.dtype))

    def meter(self) -> WindowMeter:
        """The window meter the engine's callback fed."""
        return next(
            cb.meter for cb in self.objects["trainer"].callbacks if isinstance(cb, MeasureCallback)
        )


def _flops_per_sample(module: Any, batch_size: int) -> float:
    """forward + backward FLOPs of training_step on a fresh batch, counted directly."""
    inputs = torch.randn(batch_size, module.hparams.in_features)
    targets = torch.randint(0, module.hparams.num_classes, (batch_size,))
    return (
        measure_step_flops(lambda: module.training_step((inputs, targets), 0).backward()).hardware
        / batch_size
    )


@pytest.fixture(scope="module")
def family_run() -> Callable[[str], tuple[Any, Any, Seen]]:
    """family_run(family) -> (spec, result, seen): each built-in family measured once under
    Lightning, when a test first asks for it (shared by the tests below; a worker of `-n 2` runs
    only the families its own tests read)."""
    runs: dict[str, tuple[Any, Any, Seen]] = {}

    def run(family: str) -> tuple[Any, Any, Seen]:
        if family not in runs:
            spec = load_spec(compose_config("engine=lightning", *TINY_TRIAL, *TINY_MODELS[family]))
            seen = Seen()
            runs[family] = (spec, run_trial(spec, inspect=seen), seen)
        return runs[family]

    return run


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_builtin_family_runs_under_lightning_with_warmup_excluded(family_run, family: str) -> None:
    spec, result, seen = family_run(family)
    assert result.status is Status.OK, result.reason
    m = result.metrics
    assert isinstance(seen.objects["module"], BuiltinModule)
    meter = seen.meter()
    # The window counted exactly the steps after warm-up, and every one of them was a full batch.
    assert m.timed_steps == meter.timed_steps >= 2
    assert meter.steps == spec.measure.warmup_steps + m.timed_steps
    assert meter.timed_samples == m.timed_steps * spec.loader.batch_size
    assert m.throughput == pytest.approx(meter.timed_samples / m.timed_seconds)
    assert m.step_time_ms > 0 and m.stop_reason in ("stable", "budget", "max_steps")
    assert 0.0 <= m.data_wait <= 100.0 and m.utilization == pytest.approx(100.0 - m.data_wait)
    assert m.host_data_wait == m.data_wait  # CPU: the host's wait is the device's
    assert m.peak_reserved_mb is None and m.utilization_source is m.power_source is None
    assert m.flops_per_sample and m.flops_per_sample > 0
    assert m.ceiling_throughput and m.ceiling_throughput > 0 and m.input_efficiency > 0
    assert m.mfu is None  # no documented peak for a CPU
    assert_cpu_peak(result)
    assert m.startup_time_s > 0
    # fp32 -> Lightning's "32-true": the forward really ran in float32, TF32 off.
    assert seen.objects["trainer"].precision == "32-true" and seen.output_dtypes == {torch.float32}
    assert seen.matmul_precision == "highest"


def test_flop_count_matches_the_native_engine(compose_cfg, family_run) -> None:
    native = run_trial(
        load_spec(compose_cfg(*TINY_TRIAL, *TINY_MODELS["transformer"], "measure.ceiling=false"))
    )
    lightning = family_run("transformer")[1]
    assert native.status is lightning.status is Status.OK
    assert lightning.metrics.flops_per_sample == pytest.approx(native.metrics.flops_per_sample)


def test_user_lightning_module_runs_as_is_with_its_own_dataloader(
    compose_cfg, tmp_path: Path, monkeypatch
) -> None:
    model = {"_target_": f"{HELPERS}.TinyClassifier", "batch_size": 4, "size": 32}
    spec = _user_spec(compose_cfg, model)
    assert spec.data == {}  # `~data`: the module brings its own train_dataloader
    seen = Seen()
    monkeypatch.chdir(tmp_path)
    result = run_trial(spec, inspect=seen)
    assert result.status is Status.OK, result.reason
    assert list(tmp_path.iterdir()) == []  # no lightning_logs/, no checkpoints in the cwd
    module = seen.objects["module"]
    assert type(module).__name__ == "TinyClassifier" and seen.objects["fit_data"] == {}
    assert module.dataloaders_built >= 1
    m = result.metrics
    # Its own training_step ran for warm-up + window + ceiling (warm-up and timed steps): no more.
    ceiling_steps = CEILING_WARMUP_STEPS + spec.measure.ceiling_steps
    assert module.training_steps_run == spec.measure.warmup_steps + m.timed_steps + ceiling_steps
    assert seen.meter().timed_samples == m.timed_steps * 4  # the module's batch size, not loader's
    assert m.throughput > 0 and m.flops_per_sample == pytest.approx(_flops_per_sample(module, 4))


def test_datamodule_gets_the_loader_group(compose_cfg) -> None:
    model = {"_target_": f"{HELPERS}.TinyClassifier"}
    data = {"_target_": f"{HELPERS}.TinyDataModule", "size": 48, "batch_size": 16}
    spec = _user_spec(compose_cfg, model, "loader.batch_size=6", "measure.ceiling=false", data=data)
    seen = Seen()
    result = run_trial(spec, inspect=seen)
    assert result.status is Status.OK, result.reason
    datamodule = seen.objects["fit_data"]["datamodule"]
    assert (datamodule.batch_size, datamodule.num_workers, datamodule.drop_last) == (6, 0, True)
    assert seen.meter().timed_samples == result.metrics.timed_steps * 6
    assert any("data.batch_size replaced" in w for w in result.warnings)
    # prefetch_factor etc. are not constructor arguments of TinyDataModule, but they are defaults.
    assert not any("not applied" in w for w in result.warnings)


@pytest.fixture
def restore_threads():
    """device.num_threads is process-wide (torch.set_num_threads): put it back for later tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_slow_input_shows_as_data_wait(compose_cfg, restore_threads) -> None:
    # One compute thread: the tiny step costs well under a millisecond; a batch of 8 samples at
    # sample_cost=100 costs ~80 ms of loader work in the main process (num_workers=0).
    base = [
        "engine=lightning",
        *TINY_TRIAL,
        *TINY_MODELS["mlp"],
        "measure.ceiling=false",
        "device.num_threads=1",
    ]
    fast = run_trial(load_spec(compose_cfg(*base, "data.sample_cost=0")))
    slow = run_trial(load_spec(compose_cfg(*base, "data.sample_cost=100")))
    assert fast.ok and slow.ok
    assert slow.metrics.data_wait > 60.0
    assert fast.metrics.data_wait < slow.metrics.data_wait - 30.0


def test_bf16_runs_as_lightning_bf16_mixed(compose_cfg) -> None:
    spec = load_spec(
        compose_cfg(
            "engine=lightning",
            "precision=bf16",
            *TINY_TRIAL,
            *TINY_MODELS["mlp"],
            "measure.ceiling=false",
        )
    )
    seen = Seen()
    result = run_trial(spec, inspect=seen)
    assert result.status is Status.OK, result.reason
    assert seen.objects["trainer"].precision == "bf16-mixed"
    assert seen.output_dtypes == {torch.bfloat16}  # the forward really ran under bf16 autocast


def test_precision_table_and_override(compose_cfg) -> None:
    spec = load_spec(compose_cfg("engine=lightning", "device=cpu"))

    def mapped(mode: str, override: str | None = None) -> str:
        engine = dataclasses.replace(spec.engine, precision=override)
        return lightning_precision(
            dataclasses.replace(spec, precision=PrecisionConf(mode), engine=engine)
        )

    assert [mapped(m) for m in ("fp32", "tf32", "bf16", "fp16")] == [
        "32-true",
        "32-true",
        "bf16-mixed",
        "16-mixed",
    ]
    assert mapped("bf16", override="bf16-true") == "bf16-true"


def test_missing_extra_fails_at_validation_with_install_hint(compose_cfg, monkeypatch) -> None:
    cfg = compose_cfg("engine=lightning")
    monkeypatch.setitem(sys.modules, "lightning", None)  # as if `pip install lightning` never ran
    with pytest.raises(ConfigError) as info:
        load_spec(cfg)
    assert info.value.key == "engine.name"
    assert 'pip install "gpuopt[lightning]"' in str(info.value)
    load_spec(compose_cfg("engine=native"))  # the native engine does not need it


@pytest.mark.parametrize(
    ("override", "key"),
    [("engine.name=keras", "engine.name"), ("engine.precision=fp8", "engine.precision"),
     ("engine.accumulate_grad_batches=0", "engine.accumulate_grad_batches")],
)  # fmt: skip
def test_bad_engine_settings_are_config_errors(compose_cfg, override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_spec(compose_cfg("engine=lightning", override))
    assert info.value.key == key


def test_missing_data_needs_a_module_with_its_own_dataloader(compose_cfg) -> None:
    cfg = compose_cfg("engine=lightning", "~data", "model=mlp")
    with pytest.raises(ConfigError) as info:
        load_spec(cfg)
    assert info.value.key == "data"


@pytest.mark.parametrize(
    ("cls", "status", "reason"),
    [("NaNAfter", Status.DIVERGED, "NaN"), ("OOMAfter", Status.OOM, "out of memory"),
     ("TinyClassifier", Status.ERROR, "TypeError")],
)  # fmt: skip
def test_failures_are_classified_like_the_native_engine(
    compose_cfg, cls: str, status: Status, reason: str
) -> None:
    model: dict[str, Any] = {"_target_": f"{HELPERS}.{cls}"}
    if cls == "TinyClassifier":
        model["no_such_argument"] = 1  # the constructor rejects it: an error, not oom/diverged
    else:
        model["after"] = 2
    result = run_trial(_user_spec(compose_cfg, model))
    assert result.status is status
    assert reason in result.reason


def test_fetch_timer_times_only_the_fetch_while_the_window_is_on() -> None:
    timer = FetchTimer(torch.device("cpu"))
    wait = timer.wait
    wait.active = False  # as the window meter sets it outside its window
    timer.start("[_TrainingEpochLoop].train_dataloader_next")
    timer.stop("[_TrainingEpochLoop].train_dataloader_next")
    assert wait.fetch_s == 0.0  # not active: outside the window
    wait.active = True
    timer.start("[_TrainingEpochLoop].train_dataloader_next")
    timer.start("[LightningModule]BuiltinModule.training_step")
    timer.stop("[LightningModule]BuiltinModule.training_step")
    timer.stop("[_TrainingEpochLoop].train_dataloader_next")
    waited = wait.totals()  # on CPU the device's wait is the host's fetch time
    assert wait.fetch_s > 0.0 and waited.device_s == waited.host_s == wait.fetch_s
    wait.active = False
    timer.start("[_TrainingEpochLoop].train_dataloader_next")
    wait.active = True  # a span opened outside the window does not close inside it
    timer.stop("[_TrainingEpochLoop].train_dataloader_next")
    assert wait.totals() == waited


@pytest.mark.slow
def test_gpuopt_run_with_engine_lightning_end_to_end(tmp_path: Path) -> None:
    """`python -m gpuopt.run engine=lightning`: a fresh process, result.json in the run dir only."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path / "out")}
    cmd = [sys.executable, "-m", "gpuopt.run", "engine=lightning", *TINY_TRIAL, *TINY_MODELS["mlp"]]
    done = subprocess.run(
        cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (result_file,) = (tmp_path / "out").rglob("result.json")
    result = json.loads(result_file.read_text())
    assert result["status"] == "ok" and result["metrics"]["throughput"] > 0
    assert result["config"]["engine"]["name"] == "lightning"
    assert list(cwd.iterdir()) == []
    assert not any(
        p.name in ("lightning_logs", "checkpoints") for p in (tmp_path / "out").rglob("*")
    )


def test_spec_engine_is_in_the_recorded_config(compose_cfg) -> None:
    spec = load_spec(compose_cfg("engine=lightning", "engine.gradient_clip_val=1.0"))
    assert dataclasses.asdict(spec)["engine"]["name"] == "lightning"
    assert OmegaConf.to_container(compose_cfg("engine=lightning").engine)["strategy"] == "auto"


@pytest.mark.parametrize(
    ("mode", "override", "expected"),
    [("fp32", None, "fp32"), ("tf32", None, "tf32"), ("bf16", None, "bf16"),
     ("fp16", None, "fp16"),
     # engine.precision wins: a bf16/fp16 precision.mode under "32-true" runs plain fp32 ...
     ("bf16", "32-true", "fp32"), ("fp16", "32-true", "fp32"), ("tf32", "32-true", "tf32"),
     # ... and a half-precision override of fp32 runs (and is measured against) that dtype.
     ("fp32", "bf16-true", "bf16"), ("fp32", "16-mixed", "fp16"), ("fp32", "64-true", None)],
)  # fmt: skip
def test_peak_mode_is_the_precision_the_fit_runs(compose_cfg, mode, override, expected) -> None:
    from gpuopt.engines.lightning.meter import peak_mode

    spec = load_spec(compose_cfg("engine=lightning", "device=cpu"))
    spec = dataclasses.replace(
        spec,
        precision=dataclasses.replace(spec.precision, mode=mode),
        engine=dataclasses.replace(spec.engine, precision=override),
    )
    assert peak_mode(spec) == expected


def test_flop_step_counts_the_eager_module_of_a_compiled_one_then_restores_it(compose_cfg) -> None:
    from lightning.pytorch.utilities.compile import from_compiled

    from gpuopt.trial.policies import CachePolicy

    compiled_graphs = []

    def backend(gm, example_inputs):  # would record any compilation the FLOP step triggered
        compiled_graphs.append(gm)
        return gm.forward

    cpu = torch.device("cpu")
    spec = load_spec(compose_cfg("engine=lightning", *TINY_TRIAL, "measure.warmup_steps=2"))
    module = from_compiled(
        torch.compile(BuiltinModule(torch.nn.Linear(16, 4), spec), backend=backend)
    )
    compiled_step = module.training_step
    trial = Trial(spec, cpu)
    meter = MeasureCallback(trial, FetchTimer(cpu), CachePolicy(spec.cache, cpu))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    meter.on_train_batch_start(None, module, batch, 0)  # type: ignore[arg-type]
    assert module.training_step is not compiled_step  # the eager step runs under the counter
    loss = module.training_step(batch, 0)
    loss.backward()
    meter.on_train_batch_end(None, module, loss, batch, 0)  # type: ignore[arg-type]
    assert module.training_step is compiled_step and compiled_graphs == []
    eager = measure_step_flops(lambda: module.model(batch[0]).sum().backward()).hardware / 8
    assert trial.metrics.flops_per_sample == pytest.approx(eager) and eager > 0


def test_lightning_peaks_count_from_after_the_flop_step_and_warm_up(compose_cfg, monkeypatch):
    from gpuopt.trial.memory import MemoryBaseline

    seen = Seen()
    order = []
    monkeypatch.setattr(
        MemoryBaseline, "release_cache", lambda self: order.append(("release", seen.meter().steps))
    )
    monkeypatch.setattr(
        MemoryBaseline,
        "window_starting",
        lambda self: order.append(("window", seen.meter().steps)),
    )
    spec = load_spec(
        compose_cfg("engine=lightning", *TINY_TRIAL, *TINY_MODELS["mlp"], "measure.warmup_steps=3")
    )
    result = run_trial(spec, inspect=seen)
    assert result.status is Status.OK, result.reason
    # After the eager FLOP step (the first warm-up step) the cache goes back; the peaks are reset
    # once all warm-up steps ran, as the window starts.
    assert order == [("release", 1), ("window", 3)]
