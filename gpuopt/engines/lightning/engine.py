"""The Lightning engine (`engine=lightning`): the trial runs through `lightning.Trainer.fit`, measured
by a Callback with the same clocks, stop rule, monitors and metrics as gpuopt's own loop.

gpuopt's groups map onto Lightning's own knobs:

- precision: fp32 -> `precision="32-true"` (matmul precision "highest"), tf32 -> "32-true" with
  matmul precision "high", bf16 -> "bf16-mixed", fp16 -> "16-mixed"; `engine.precision` overrides
  the mapping with any Lightning precision string (e.g. "bf16-true").
- compile: `torch.compile(LightningModule)`; Lightning compiles its forward and training_step.
- loader: gpuopt's DataLoader (`gpuopt.engines._common.build_loader`) for a Dataset; for a
  LightningDataModule, the loader knobs its constructor accepts (batch_size, num_workers, ...).
- device: accelerator/devices; cache.cudnn_benchmark -> `Trainer(benchmark=...)`.

The model is either a built-in (or any) `nn.Module`, wrapped in `BuiltinModule` with gpuopt's loss and
optimizer config, or the user's own `LightningModule`, run as is: its training_step,
configure_optimizers, and its train_dataloader unless `data._target_` names a Dataset or DataModule.

Measuring (`MeasureCallback`): batch ends are the step boundaries (`gpuopt.trial.measure` clocks: CUDA
events, no per-step host sync); the first step is timed apart as compile_time_s when compile is on;
`measure.warmup_steps` more steps are excluded (the first of them runs the eager module under
FlopCounterMode for MFU, so warmup_time_s includes that counting); then the timed window runs until
`gpuopt.trial.measure.StopRule` says stop and sets `trainer.should_stop`. Input wait is marked by
`FetchTimer` around Lightning's `next(dataloader)` (its profiler's `train_dataloader_next` action)
and its host-to-device copy (`batch_to_device`): `data_wait` is the device's starvation (on CUDA
read on the GPU timeline), `host_data_wait` the host's fetch time (`gpuopt.engines._common.InputWait`).
Lightning's own per-step work (hooks, progress tracking) is inside the step time: that overhead is
part of what this engine costs.

The compute ceiling replays the first batch of the fit (already on the device) through a second
`Trainer.fit` on the same module, timed by `gpuopt.engines._common.CeilingReplay` like the native one.

Nothing is written to the working directory: no checkpoints, no logger, no progress bar;
`default_root_dir` is the Hydra run dir (or a temporary directory outside Hydra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.data import extract_batch_size

from gpuopt.core.checks import measure_conf
from gpuopt.core.host import cpu_ticks, steal_percent
from gpuopt.core.result import Status, TrialResult
from gpuopt.core.spec import EngineConf, MeasureConf, TrialSpec
from gpuopt.engines._common import (
    CeilingReplay,
    EpochBoundary,
    InputWait,
    InputWaitSeconds,
    MemoryBaseline,
    NonFiniteLoss,
    Trial,
    WindowMonitors,
    apply_policies,
    build_loader,
    build_loss,
    build_optimizer,
    classify_failure,
    flop_notes,
    instantiate_data,
    instantiate_model,
    measure_epoch_boundary,
    measure_loader_cost,
    measuring_spec,
    model_loss,
    move_batch,
    process_start_time,
    record_achievable_mfu,
    record_batches,
    record_limit,
    record_steady_state,
    record_window,
    release,
    run_measured,
)
from gpuopt.trial import knobs
from gpuopt.trial.measure import StopRule, WindowResult, make_clock, step_flop_counter, synchronize

log = logging.getLogger(__name__)

# gpuopt precision mode -> Lightning `Trainer(precision=...)`.
PRECISION_TO_LIGHTNING = {
    "fp32": "32-true",
    "tf32": "32-true",
    "bf16": "bf16-mixed",
    "fp16": "16-mixed",
}
# Lightning precision string -> the dtype whose documented peak MFU is measured against.
_PEAK_MODE = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}
# Warnings Lightning gives for every trial that say nothing about the configuration.
_IGNORED_WARNINGS = (
    "does not have many workers",  # gpuopt's loader group is the place to tune num_workers
    "GPU available but not used",
    "`max_epochs=-1`",
    "treespec",  # Lightning 2.6's use of a torch pytree API that torch 2.13 deprecates
)


def lightning_precision(spec: TrialSpec) -> str:
    return spec.engine.precision or PRECISION_TO_LIGHTNING[spec.precision.mode]


def peak_mode(spec: TrialSpec) -> str | None:
    """The precision mode for the peak-FLOP/s lookup (MFU) of the precision the fit actually runs
    (`engine.precision` wins over `precision.mode`); None when there is no documented peak."""
    precision = lightning_precision(spec)
    if precision == "32-true":
        # float32 math: TF32 tensor cores only where precision.mode=tf32 set the matmul precision
        # to "high" (a bf16/fp16 precision.mode overridden by "32-true" runs plain fp32).
        return "tf32" if spec.precision.mode == "tf32" else "fp32"
    return _PEAK_MODE.get(precision)


def accelerator_and_devices(device: torch.device) -> tuple[str, list[int] | int]:
    """Lightning's (accelerator, devices) for one torch device: one device per trial."""
    if device.type == "cuda":
        return "cuda", [device.index or 0]
    return device.type, 1


class BuiltinModule(pl.LightningModule):
    """A plain `nn.Module` (a built-in family or the user's own) trained the gpuopt way: the loss
    named by `loss`, the optimizer group, channels_last inputs when the model is channels_last."""

    def __init__(self, model: torch.nn.Module, spec: TrialSpec) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.channels_last = bool(spec.model.get("channels_last", False))
        self.loss = build_loss(spec)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # Any batch structure, the native engine's model contract (gpuopt.engines._common).
        if self.channels_last:
            batch = move_batch(batch, self.device, channels_last=True)
        return model_loss(self, batch, self.loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.spec, self.model.parameters())


class FetchTimer(Profiler):
    """Lightning's profiler hook, used only to mark what the input pipeline costs the loop: the
    fetch (`next(dataloader)`) and host-to-device copy spans of each step, given to `InputWait`
    (host fetch time; on CUDA the GPU's starvation, read with events on the stream Lightning
    copies on). Only while `active` (the timed window)."""

    FETCH = "train_dataloader_next"
    COPY = "batch_to_device"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.active = False
        self.wait = InputWait(device)

    @property
    def fetch_s(self) -> float:
        return self.wait.fetch_s

    def reset(self) -> None:
        self.wait.reset()

    def start(self, action_name: str) -> None:
        if not self.active:
            return
        if action_name.endswith(self.FETCH):
            self.wait.fetch_started()
        elif action_name.endswith(self.COPY):
            self.wait.copy_started()

    def stop(self, action_name: str) -> None:
        if not self.active:  # no span may close after the window's closing synchronize
            return
        if action_name.endswith(self.FETCH):
            self.wait.fetch_ended()
        elif action_name.endswith(self.COPY):
            self.wait.copy_ended()

    def wait_seconds(self) -> InputWaitSeconds:
        """The window's input wait (call after the window's closing synchronize)."""
        return self.wait.totals()


def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss in what training_step returned (a tensor, or a dict with "loss")."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss if isinstance(loss, torch.Tensor) else None


def use_eager_steps(module: pl.LightningModule) -> dict[str, Any] | None:
    """Point a compiled LightningModule's forward and training_step back to its eager ones
    (Lightning's `from_compiled` keeps them in `_compiler_ctx`, and its strategies look these
    attributes up at each call); the compiled ones to restore, None when it is not compiled."""
    ctx = getattr(module, "_compiler_ctx", None)
    if not ctx:
        return None
    compiled = {"forward": module.forward, "training_step": module.training_step}
    module.forward = ctx["original_forward"]  # type: ignore[method-assign]
    module.training_step = ctx["original_training_step"]  # type: ignore[method-assign]
    return compiled


class MeasureCallback(pl.Callback):
    """Compile step, warm-up (the FLOP count on its first step, run eagerly), then the timed
    window until the stop rule ends it. Results stay on the callback: `window`, `timed_samples`,
    `nvml`, `first_batch` (the fit's first batch, on the device: the ceiling replays it), ..."""

    def __init__(
        self,
        spec: TrialSpec,
        device: torch.device,
        fetch_timer: FetchTimer,
        cache_policy: knobs.CachePolicy,
        notes: list[str],
        memory: MemoryBaseline | None = None,
    ) -> None:
        measure = spec.measure
        self.spec = spec
        self.device = device
        self.memory = memory or MemoryBaseline.take(device)
        self.fetch_timer = fetch_timer
        self.cache_policy = cache_policy
        self.notes = notes
        self.monitors = WindowMonitors(device, measure.nvml_interval_s, notes)
        self.rule = StopRule.from_measure(measure)
        self.clock = make_clock(device)
        self.compile_steps = 0 if spec.compile.mode == "off" else 1
        self.untimed_steps = self.compile_steps + measure.warmup_steps
        self.flop_step = (
            self.compile_steps if measure.count_flops and measure.warmup_steps >= 1 else None
        )
        if measure.count_flops and self.flop_step is None:
            notes.append(
                "flops_per_sample and mfu need measure.warmup_steps >= 1 under engine=lightning"
            )
        # After the one-off steps (compile, eager FLOP count) their cached blocks go back.
        self.release_cache_after = self.compile_steps + (self.flop_step is not None)
        self.nonfinite = NonFiniteLoss()
        self.steps = 0  # optimizer steps completed in this fit (batches without accumulation)
        # With accumulation a step ends when Lightning steps the optimizer (trainer.global_step
        # moves; also at an epoch's end with fewer micro-batches): samples count up till then.
        self.accumulating = spec.accumulation_steps > 1
        self._optimizer_steps = 0
        self._pending_samples = 0
        # Filled as the fit runs.
        self.compile_time_s: float | None = None
        self.warmup_time_s: float | None = None
        self.flops_per_sample: float | None = None  # model FLOPs (recompute apart)
        self.hardware_flops_per_sample: float | None = None
        self.window: WindowResult | None = None
        self.timed_steps = 0
        self.timed_samples = 0
        self.nvml: Any = None
        self.keep_first_batch = measure.ceiling
        self.first_batch: Any = None
        self._flop_counter: Any = None  # measure.step_flop_counter() during the FLOP step
        self._compiled_steps: dict[str, Any] | None = None  # restored after the FLOP step
        self._first_step_t0 = self._warmup_t0 = self._window_t0 = self._first_step_at = 0.0
        self._window_ticks: dict[str, int] | None = None

    # -- hooks -------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._warmup_t0 = time.perf_counter()
        if self.untimed_steps == 0:
            self._start_window()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.steps == 0:
            self._first_step_t0 = time.perf_counter()
            if self.keep_first_batch:
                self.first_batch = batch  # already moved to the device by Lightning
        if self.steps == self.flop_step and self._flop_counter is None:
            # Counts the matmul/conv/attention FLOPs of this whole step: forward and backward
            # (the optimizer's elementwise ops are not counted), on the eager module as the
            # native engine does (through a compiled step the counter would miss kernels).
            self._compiled_steps = use_eager_steps(pl_module)
            self._flop_counter = step_flop_counter()
            self._flop_counter.__enter__()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.nonfinite.update(_loss_of(outputs))
        if self._flop_counter is not None:
            self._end_flop_step(pl_module, batch)
        self._pending_samples += extract_batch_size(batch)
        if self.accumulating:
            if trainer.global_step == self._optimizer_steps:
                return  # a micro-batch inside the optimizer step
            self._optimizer_steps = trainer.global_step
        samples, self._pending_samples = self._pending_samples, 0
        self.steps += 1
        if self._window_t0 and self.window is None:
            self._timed_step(trainer, samples)
            return
        if self.steps == self.release_cache_after:
            self.memory.release_cache()
        if self.compile_steps and self.steps == self.compile_steps:
            synchronize(self.device)
            now = time.perf_counter()
            self.compile_time_s = now - self._first_step_t0
            self._warmup_t0 = now
        if self.steps == self.untimed_steps:
            synchronize(self.device)
            self.warmup_time_s = time.perf_counter() - self._warmup_t0
            self.nonfinite.check("warm-up")
            self._start_window()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._flop_counter is not None:
            self._flop_counter.__exit__(None, None, None)
            self._flop_counter = None
        self._restore_compiled_steps(pl_module)
        self.monitors.stop()

    # -- the FLOP step -----------------------------------------------------------------------
    def _end_flop_step(self, pl_module: pl.LightningModule, batch: Any) -> None:
        counter, self._flop_counter = self._flop_counter, None
        counter.__exit__(None, None, None)  # type: ignore[union-attr]
        self._restore_compiled_steps(pl_module)
        flops = counter.step_flops()  # type: ignore[union-attr]
        samples = extract_batch_size(batch)
        self.flops_per_sample = flops.model / samples if flops.hardware else None
        self.hardware_flops_per_sample = flops.hardware / samples if flops.hardware else None
        self.notes += flop_notes(self.spec, self.device, peak_mode(self.spec), flops)

    def _restore_compiled_steps(self, pl_module: pl.LightningModule) -> None:
        compiled, self._compiled_steps = self._compiled_steps, None
        for name, step in (compiled or {}).items():
            setattr(pl_module, name, step)

    # -- the window --------------------------------------------------------------------------
    def _start_window(self) -> None:
        self.memory.window_starting()
        self.monitors.start()
        self.fetch_timer.reset()
        self.fetch_timer.active = True
        self._window_ticks = cpu_ticks()
        self.clock.start()
        self._first_step_at = time.time()
        self._window_t0 = time.perf_counter()

    def _timed_step(self, trainer: pl.Trainer, samples: int) -> None:
        self.clock.mark()
        self.timed_steps += 1
        self.timed_samples += samples
        self.cache_policy.after_step(self.timed_steps - 1)
        elapsed = time.perf_counter() - self._window_t0
        rule = self.rule
        reason = None
        # Reading completed step times queries CUDA events: only once a stop is possible.
        if self.timed_steps >= rule.min_steps or elapsed >= rule.time_budget_s:
            reason = rule.check(self.clock.completed_step_times(), elapsed)
        if reason is not None:
            self._end_window(trainer, reason)

    def _end_window(self, trainer: pl.Trainer, reason: str) -> None:
        step_times, wall = self.clock.finish()  # synchronizes on CUDA
        self.fetch_timer.active = False
        self.nvml = self.monitors.stop()
        steal = steal_percent(self._window_ticks, cpu_ticks())
        self.window = WindowResult(
            step_times, wall, self.timed_steps, reason, self._first_step_at, steal_pct=steal
        )
        trainer.should_stop = True
        self.nonfinite.check("the timed window")


class CeilingCallback(pl.Callback):
    """The compute ceiling under Lightning: `replay` (gpuopt's CeilingReplay) times the steps of a
    fit over one batch already on the device (Lightning's per-step work included, no loader)."""

    def __init__(self, replay: CeilingReplay) -> None:
        self.replay = replay
        self.nonfinite = NonFiniteLoss()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.replay.begin()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.nonfinite.update(_loss_of(outputs))
        if self.replay.step_done(extract_batch_size(batch)):
            trainer.should_stop = True
            self.nonfinite.check("the compute-ceiling replay")


class _RepeatedBatch:
    """One batch, `length` times: the ceiling's 'data loader' (no loader work, already on device)."""

    def __init__(self, batch: Any, length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        return (self.batch for _ in range(self.length))


def _datamodule_loader_kwargs(
    spec: TrialSpec, cls: type, device: torch.device, notes: list[str]
) -> dict[str, Any]:
    """The loader knobs a DataModule's constructor accepts (loader.* wins over data.*)."""
    params = inspect.signature(cls.__init__).parameters
    knobs = dataclasses.asdict(spec.loader)
    # Page-locked memory only helps host-to-device copies; without an accelerator it is a no-op.
    knobs["pin_memory"] = knobs["pin_memory"] and device.type != "cpu"
    defaults = dataclasses.asdict(type(spec.loader)())
    accepted = {k: v for k, v in knobs.items() if k in params}
    overridden = sorted(k for k in accepted if k in spec.data and spec.data[k] != accepted[k])
    if overridden:
        notes.append(f"data.{', data.'.join(overridden)} replaced by the loader group's value(s)")
    ignored = sorted(k for k, v in knobs.items() if k not in params and v != defaults[k])
    if ignored:
        notes.append(
            f"loader.{', loader.'.join(ignored)} not applied: {cls.__name__}.__init__ does not take them"
        )
    return accepted


def build_lightning_workload(
    spec: TrialSpec, device: torch.device, notes: list[str]
) -> tuple[pl.LightningModule, dict[str, Any]]:
    """The LightningModule to fit and the data arguments of `Trainer.fit`."""
    from hydra.utils import get_object

    torch.manual_seed(spec.seed)
    built = instantiate_model(spec)
    if isinstance(built, pl.LightningModule):
        module = built
        if spec.model.get("channels_last"):
            notes.append(
                "model.channels_last not applied: a LightningModule formats its own inputs"
            )
    elif isinstance(built, torch.nn.Module):
        if spec.model.get("channels_last"):
            built = built.to(memory_format=torch.channels_last)
        module = BuiltinModule(built, spec)
    else:
        raise TypeError(
            f"model._target_={spec.model['_target_']} built a {type(built).__name__}, "
            "not an nn.Module or LightningModule"
        )

    data_target = spec.data.get("_target_")
    data_cls = get_object(data_target) if data_target else None
    if isinstance(data_cls, type) and issubclass(data_cls, pl.LightningDataModule):
        kwargs = _datamodule_loader_kwargs(spec, data_cls, device, notes)
        return module, {"datamodule": instantiate_data(spec, **kwargs)}
    if isinstance(built, pl.LightningModule) and owns_train_dataloader(built):
        if data_target:
            notes.append(
                f"data ({data_target}) and the loader group not used: "
                f"{type(built).__name__} brings its own train_dataloader"
            )
        return module, {}
    if data_cls is None:
        raise TypeError(
            f"{type(built).__name__} has no train_dataloader and no data._target_ is set: "
            "give a Dataset or LightningDataModule as data._target_"
        )
    dataset = instantiate_data(spec)
    return module, {"train_dataloaders": build_loader(spec, dataset, device, notes)}


def owns_train_dataloader(module: Any) -> bool:
    """Whether a LightningModule (class or instance) overrides Lightning's train_dataloader hook."""
    cls = module if isinstance(module, type) else type(module)
    return getattr(cls, "train_dataloader", None) is not pl.LightningModule.train_dataloader


def make_trainer(
    spec: TrialSpec,
    device: torch.device,
    callbacks: list[pl.Callback],
    profiler: Profiler | None,
    root: Path,
) -> pl.Trainer:
    accelerator, devices = accelerator_and_devices(device)
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=spec.engine.strategy,
        precision=lightning_precision(spec),  # type: ignore[arg-type]
        benchmark=bool(spec.cache.cudnn_benchmark),
        # Lightning divides each micro-batch loss by this count itself.
        accumulate_grad_batches=spec.accumulation_steps,
        gradient_clip_val=spec.engine.gradient_clip_val,
        # The callback ends the fit (trainer.should_stop); epochs restart the loader as needed.
        max_epochs=-1,
        max_steps=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        profiler=profiler,
        # Nothing into the user's cwd: no checkpoints, no logs, no progress bar.
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )


@contextlib.contextmanager
def _trainer_root() -> Iterator[Path]:
    """Hydra's run dir when inside a Hydra job, else a temporary directory removed afterwards."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        yield Path(HydraConfig.get().runtime.output_dir)
        return
    with tempfile.TemporaryDirectory(prefix="gpuopt-lightning-") as root:
        yield Path(root)


@contextlib.contextmanager
def _lightning_output(notes: list[str]) -> Iterator[None]:
    """Quiet Lightning's per-fit info lines; keep its warnings about the configuration as notes."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=False):
            lg.setLevel(level)
    seen: set[str] = set()
    for warning in caught:
        text = str(warning.message).strip().splitlines()[0]
        if text in seen or any(ignored in text for ignored in _IGNORED_WARNINGS):
            continue
        seen.add(text)
        notes.append(f"lightning: {text}")


def measure(trial: Trial, process_t0: float) -> None:
    """The engine (`gpuopt.engines.ENGINES["lightning"]`): fill `trial.metrics` by fitting with
    lightning.Trainer, raising on failure (Diverged, OOM, errors: `gpuopt.engines.run_trial`
    classifies them)."""
    spec, device = trial.spec, trial.device
    memory = MemoryBaseline.take(device)
    # Process-wide settings, float32 matmul precision (TF32 on/off) included. Lightning's precision
    # plugin does the autocast and the fp16 GradScaler: the precision policy is not used here.
    cache_policy = apply_policies(spec, device).cache
    record_batches(trial)
    module, fit_data = build_lightning_workload(spec, device, trial.warnings)
    trial.show("module", module)
    trial.show("fit_data", fit_data)
    # Lightning recognises the compiled wrapper and compiles forward and training_step.
    fit_module = knobs.compile_function(module, spec.compile)
    fetch_timer = FetchTimer(device)
    meter = MeasureCallback(spec, device, fetch_timer, cache_policy, trial.warnings, memory)
    with _trainer_root() as root, _lightning_output(trial.warnings):
        trainer = make_trainer(spec, device, [meter], fetch_timer, root)
        trial.show("trainer", trainer)
        trainer.fit(fit_module, **fit_data)
        _record_fit(trial, meter, fetch_timer, memory, process_t0)
        loader_cost = _beside_fit(trial, trainer.train_dataloader, fetch_timer.fetch_s, meter)
        batch, meter.first_batch = meter.first_batch, None
        if spec.profile.enabled:  # a short extra fit under torch.profiler (gpuopt.trial.profile)
            from gpuopt.engines.lightning.profile import profiled_fit

            summary = profiled_fit(
                spec,
                device,
                trainer.lightning_module,
                fit_data,
                lambda callbacks, spans: make_trainer(spec, device, callbacks, spans, root),
            )
            trial.profile = summary.to_dict()
        ceiling = None
        if spec.measure.ceiling and batch is not None:
            # trainer.lightning_module: the fitted module (already compiled, if compile is on).
            ceiling = _compute_ceiling(trial, trainer.lightning_module, batch, root)
        record_limit(trial.metrics, device, loader_cost, ceiling)
        if spec.measure.peak_probe:
            record_achievable_mfu(trial.metrics, device, peak_mode(spec))


def _beside_fit(
    trial: Trial, loader: Any, fetch_wait_s: float, meter: MeasureCallback
) -> float | None:
    """After the fit, outside any timed span: the epoch boundary's cost (the fit stopped its
    workers) and the input pipeline's cost per sample, for a torch DataLoader; (a CombinedLoader
    or a user's own iterable is not priced: throughput_amortized is then the throughput)."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        trial.warnings.append(
            "epoch_overhead_s and loader_cost_us not measured: the train dataloader is a "
            f"{type(loader).__name__}, not one torch DataLoader"
        )
        record_steady_state(trial.metrics, EpochBoundary(None, 0.0, None))
        return None
    boundary = measure_epoch_boundary(trial.spec, loader, fetch_wait_s, meter.timed_steps)
    record_steady_state(trial.metrics, boundary)
    shutdown = getattr(getattr(loader, "_iterator", None), "_shutdown_workers", None)
    if shutdown is not None:  # persistent workers: stopped before the ceiling runs
        shutdown()
    return measure_loader_cost(loader) if trial.spec.measure.loader_cost else None


def _record_fit(
    trial: Trial,
    meter: MeasureCallback,
    fetch_timer: FetchTimer,
    memory: MemoryBaseline,
    process_t0: float,
) -> None:
    """The metrics of the fit the callback measured (an error if it ended before the window did)."""
    m = trial.metrics
    if meter.window is None:
        raise RuntimeError(
            f"the fit ended after {meter.steps} steps, before the timed window did "
            "(did the train_dataloader yield no batches?)"
        )
    m.compile_time_s = meter.compile_time_s if meter.compile_steps else 0.0
    m.warmup_time_s = meter.warmup_time_s
    m.flops_per_sample = meter.flops_per_sample
    m.hardware_flops_per_sample = meter.hardware_flops_per_sample
    record_window(
        m,
        meter.window,
        samples=meter.timed_samples,
        input_wait=fetch_timer.wait_seconds(),
        device=trial.device,
        nvml=meter.nvml,
        memory=memory,
        precision_mode=peak_mode(trial.spec),
        process_t0=process_t0,
    )


def _compute_ceiling(
    trial: Trial, module: pl.LightningModule, batch: Any, root: Path
) -> CeilingReplay:
    """The fitted module trained on `batch` (on the device) by a second fit, no loader."""
    replay = CeilingReplay.for_trial(trial.spec, trial.device)
    ceiling = CeilingCallback(replay)
    trainer = make_trainer(trial.spec, trial.device, [ceiling], None, root)
    trainer.fit(module, train_dataloaders=_RepeatedBatch(batch, replay.max_batches))
    replay.record(trial.metrics)
    return replay


def run_lightning_trial(
    spec: TrialSpec, device: torch.device | None = None, inspect: Any = None
) -> TrialResult:
    """Measure `spec` under the Lightning engine (whatever `spec.engine.name` says), with the same
    failure handling and result as `gpuopt.engines.run_trial`."""
    from gpuopt.trial.numerics import guard_result

    engine = dataclasses.replace(spec.engine, name="lightning")
    spec = dataclasses.replace(spec, engine=engine)
    result = run_measured(spec, lambda: measure, device=device, inspect=inspect)
    return guard_result(spec, device, result)


# -- the public callback: gpuopt's measurement in the user's own Trainer ---------------------------
class _TeeProfiler(Profiler):
    """The user's profiler, unchanged, plus gpuopt's FetchTimer seeing the same actions."""

    def __init__(self, inner: Profiler, timer: FetchTimer) -> None:
        super().__init__()
        self.inner, self.timer = inner, timer

    def start(self, action_name: str) -> None:
        self.inner.start(action_name)
        self.timer.start(action_name)

    def stop(self, action_name: str) -> None:
        self.timer.stop(action_name)
        self.inner.stop(action_name)

    def summary(self) -> str:
        return self.inner.summary()

    def describe(self) -> None:
        self.inner.describe()

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)


class UserMeasureCallback(pl.Callback):
    """`gpuopt.MeasureCallback`: add it to your own `Trainer` to measure your own fit the way a
    gpuopt trial is measured (no gpuopt config needed): the first step apart as compile_time_s when
    `compiled`, `measure.warmup_steps` more (the first under FlopCounterMode for MFU), then the timed
    window until the stability stop, which ends the fit (`trainer.should_stop`). Data wait is the
    time Lightning spends in `next(dataloader)` and its host-to-device copy (a profiler beside
    yours). Afterwards `result` is a `TrialResult` (no compute ceiling: that needs a second fit;
    gpuopt.measure_step or engine=lightning measure it).

    `fit(trainer, model, ...)` runs `trainer.fit` and returns the result, never raising for a
    failing fit (OOM, NaN/inf loss, errors are the status). Calling `trainer.fit` yourself works
    too: a failure then raises as usual, after `result` recorded it."""

    def __init__(
        self, measure: MeasureConf | dict[str, Any] | str | None = None, compiled: bool = False
    ) -> None:
        self.measure = measure_conf(measure)
        self.compiled = compiled
        self.result: TrialResult | None = None
        self._meter: MeasureCallback | None = None
        self._trial: Trial | None = None
        self._user_profiler: Profiler | None = None

    def fit(self, trainer: pl.Trainer, model: pl.LightningModule, **fit_kwargs: Any) -> TrialResult:
        """`trainer.fit(model, **fit_kwargs)` measured; failures come back as the status."""
        try:
            trainer.fit(model, **fit_kwargs)
        except Exception as exc:
            if self.result is None or self.result.ok:
                self.result = self._failed(exc)
        assert self.result is not None
        return self.result

    # -- hooks -------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        spec = _callback_spec(device, self.measure, self.compiled, str(trainer.precision))
        self._trial = Trial(spec, device)
        self._memory = MemoryBaseline.take(device)
        self._process_t0 = process_start_time() or time.time()
        self._timer = FetchTimer(device)
        cache_policy = knobs.CachePolicy(spec.cache, device)
        self._meter = MeasureCallback(spec, device, self._timer, cache_policy, self._trial.warnings)
        self.result = None
        self._user_profiler = trainer.profiler
        trainer.profiler = _TeeProfiler(trainer.profiler, self._timer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._meter is not None:
            self._meter.on_train_start(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._meter is not None:
            self._meter.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._meter is not None:
            self._meter.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._meter is not None:
            self._meter.on_exception(trainer, pl_module, exception)
            if isinstance(exception, Exception):
                self.result = self._failed(exception)
        self._restore_profiler(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._meter is None or self._trial is None:
            return
        self._restore_profiler(trainer)
        if self.result is None:
            try:
                _record_fit(self._trial, self._meter, self._timer, self._memory, self._process_t0)
                self.result = self._finished(Status.OK, None)
            except Exception as exc:
                self.result = self._failed(exc)

    # -- the result --------------------------------------------------------------------------
    def _restore_profiler(self, trainer: pl.Trainer) -> None:
        if self._user_profiler is not None:
            trainer.profiler, self._user_profiler = self._user_profiler, None

    def _failed(self, exc: Exception) -> TrialResult:
        status, reason = classify_failure(exc)
        if status is Status.OOM and self._trial is not None:
            release(self._trial, status)
        return self._finished(status, reason)

    def _finished(self, status: Status, reason: str | None) -> TrialResult:
        from gpuopt.env import fingerprint

        trial = self._trial
        assert trial is not None
        return TrialResult(
            status=status,
            metrics=trial.metrics,
            reason=reason,
            config={
                "engine": {"name": "lightning_callback"},
                "measure": dataclasses.asdict(self.measure),
                "precision": {"lightning": trial.spec.engine.precision},
            },
            env=fingerprint(trial.device),
            warnings=trial.warnings,
        )


def _callback_spec(
    device: torch.device, measure: MeasureConf, compiled: bool, precision: str
) -> TrialSpec:
    """What MeasureCallback reads: the measure settings, whether the first step compiles, and the
    Trainer's precision (MFU's peak)."""
    return measuring_spec(
        device,
        measure,
        EngineConf(name="lightning", precision=precision),
        precision_mode=_PEAK_MODE.get(precision, "fp32"),
        compile_mode="default" if compiled else "off",
    )
