"""Measuring a Lightning fit (`MeasureCallback`, the engine's meter, also inside the public
`gpuopt.MeasureCallback`): the same clocks, stop rule, monitors and metrics as gpuopt's own loop.

Batch ends are the step boundaries (`gpuopt.trial.measure` clocks: CUDA events, no per-step host
sync); the first step is timed apart as compile_time_s when compile is on; `measure.warmup_steps`
more steps are excluded (the first of them runs the eager module under FlopCounterMode for MFU, so
warmup_time_s includes that counting); then the timed window runs until
`gpuopt.trial.measure.StopRule` says stop and sets `trainer.should_stop`. Input wait is marked by
`FetchTimer` around Lightning's `next(dataloader)` (its profiler's `train_dataloader_next` action)
and its host-to-device copy (`batch_to_device`): `data_wait` is the device's starvation (on CUDA
read on the GPU timeline), `host_data_wait` the host's fetch time (`gpuopt.engines._window.InputWait`).
Lightning's own per-step work (hooks, progress tracking) is inside the step time: that overhead is
part of what this engine costs. `record_fit` turns what the meter saw into the trial's metrics.

In a rank of a distributed trial (`ranks`, gpuopt.engines._distributed.Ranks) the window is
aligned as the native engine aligns it (`Ranks.align`): it starts at a barrier of every rank, and
the stop rule is rank 0's, read at the same optimizer-step counts on every rank
(`gpuopt.trial.measure.next_stop_check`'s schedule, never a clock's) and broadcast, so every rank
sets `trainer.should_stop` after the same step and runs the same number of steps.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.data import extract_batch_size

from gpuopt.core.host import cpu_ticks, steal_percent
from gpuopt.core.spec import TrialSpec
from gpuopt.engines._distributed import Ranks
from gpuopt.engines._window import (
    InputWait,
    InputWaitSeconds,
    WindowMonitors,
    flop_notes,
    record_window,
)
from gpuopt.engines.lightning.precision import peak_mode
from gpuopt.trial import policies
from gpuopt.trial.context import Trial
from gpuopt.trial.failures import NonFiniteLoss
from gpuopt.trial.measure import (
    StopRule,
    WindowResult,
    make_clock,
    next_stop_check,
    step_flop_counter,
    synchronize,
)
from gpuopt.trial.memory import MemoryBaseline


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


def loss_of(outputs: Any) -> torch.Tensor | None:
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
        cache_policy: policies.CachePolicy,
        notes: list[str],
        memory: MemoryBaseline | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        measure = spec.measure
        self.spec = spec
        self.device = device
        self.memory = memory or MemoryBaseline.take(device)
        self.fetch_timer = fetch_timer
        self.cache_policy = cache_policy
        self.notes = notes
        self.monitors = WindowMonitors(device, measure.nvml_interval_s, notes)
        self.rule: Any = StopRule.from_measure(measure)
        self.clock: Any = make_clock(device)
        # A distributed trial's clock (window started at a barrier) and rule (rank 0's, agreed).
        self.aligned = ranks is not None
        if ranks is not None:
            self.clock, self.rule = ranks.align(self.clock, self.rule)
        self._next_check = self.rule.min_steps  # the aligned rule's schedule (step counts)
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
        self.nonfinite.update(loss_of(outputs))
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
        reason = self._aligned_check(elapsed) if self.aligned else self._check(elapsed)
        if reason is not None:
            self._end_window(trainer, reason)

    def _check(self, elapsed: float) -> str | None:
        rule = self.rule
        # Reading completed step times queries CUDA events: only once a stop is possible.
        if self.timed_steps >= rule.min_steps or elapsed >= rule.time_budget_s:
            return rule.check(self.clock.completed_step_times(), elapsed)
        return None

    def _aligned_check(self, elapsed: float) -> str | None:
        """The agreed rule, read (a collective: every rank at once) at step counts alone."""
        steps = self.timed_steps
        due = steps >= self._next_check
        if not (due or steps >= self.rule.max_steps):
            return None
        if due:
            self._next_check = next_stop_check(steps)
        return self.rule.check(self.clock.completed_step_times(), elapsed, steps)

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


def record_fit(
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
