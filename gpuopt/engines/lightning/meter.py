"""Measuring a Lightning fit (`MeasureCallback`, also inside the public `gpuopt.MeasureCallback`):
Lightning's hooks pushed into the one window meter (gpuopt.engines._meter.WindowMeter).

Batch ends are the step boundaries (an optimizer step's, with gradient accumulation). Input wait
is marked by `FetchTimer` around Lightning's `next(dataloader)` and its host-to-device copy.
Lightning's own per-step work (hooks, progress tracking) is inside the step time: that overhead
is part of what this engine costs. gpuopt's precision modes map to Lightning's precision strings
here too (`lightning_precision`), and those to the dtype whose peak MFU is read against.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.data import extract_batch_size

from gpuopt.core.spec import TrialSpec
from gpuopt.engines._distributed import Ranks
from gpuopt.engines._loss import step_loss
from gpuopt.engines._meter import WindowMeter
from gpuopt.engines._window import InputWait
from gpuopt.trial import policies
from gpuopt.trial.context import Trial
from gpuopt.trial.memory import MemoryBaseline

# gpuopt precision mode -> Lightning `Trainer(precision=...)`.
PRECISION_TO_LIGHTNING = {
    "fp32": "32-true",
    "tf32": "32-true",
    "bf16": "bf16-mixed",
    "fp16": "16-mixed",
}
# Lightning precision string -> the dtype whose documented peak MFU is measured against.
PEAK_MODE = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


def lightning_precision(spec: TrialSpec) -> str:
    """The Trainer's precision: `engine.precision`, else the precision group's mapping."""
    return spec.engine.precision or PRECISION_TO_LIGHTNING[spec.precision.mode]


def peak_mode(spec: TrialSpec) -> str | None:
    """The precision mode for MFU's peak of the precision the fit runs; None without a peak."""
    precision = lightning_precision(spec)
    if precision == "32-true":
        # float32 math: TF32 tensor cores only where precision.mode=tf32 set the matmul precision
        # to "high" (a bf16/fp16 precision.mode overridden by "32-true" runs plain fp32).
        return "tf32" if spec.precision.mode == "tf32" else "fp32"
    return PEAK_MODE.get(precision)


class FetchTimer(Profiler):
    """Lightning's profiler hook, used only to mark the fetch and host-to-device copy spans of
    each step for `InputWait` (on CUDA read with events on the stream Lightning copies on).
    `inner`: the user's own profiler (gpuopt.MeasureCallback), which sees every action as before."""

    FETCH = "train_dataloader_next"
    COPY = "batch_to_device"

    def __init__(self, device: torch.device, inner: Profiler | None = None) -> None:
        super().__init__()
        self.wait, self.inner = InputWait(device), inner

    def start(self, action_name: str) -> None:
        if self.inner is not None:
            self.inner.start(action_name)
        if action_name.endswith(self.FETCH):
            self.wait.fetch_started()
        elif action_name.endswith(self.COPY):
            self.wait.copy_started()

    def stop(self, action_name: str) -> None:
        if action_name.endswith(self.FETCH):
            self.wait.fetch_ended()
        elif action_name.endswith(self.COPY):
            self.wait.copy_ended()
        if self.inner is not None:
            self.inner.stop(action_name)

    def summary(self) -> str:
        return (self.inner or super()).summary()

    def describe(self) -> None:
        (self.inner or super()).describe()

    def teardown(self, stage: str | None) -> None:
        (self.inner or super()).teardown(stage)


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
    """Lightning's hooks pushed into the window meter; the stop rule's end sets
    `trainer.should_stop`. `first_batch`: the fit's first batch, on the device (the ceiling
    replays it)."""

    def __init__(
        self,
        trial: Trial,
        fetch_timer: FetchTimer,
        cache_policy: policies.CachePolicy,
        memory: MemoryBaseline | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        spec = trial.spec
        self.meter = WindowMeter(
            trial,
            ranks,
            wait=fetch_timer.wait,
            memory=memory,
            after_step=cache_policy.after_step,
            precision_mode=peak_mode(spec),
        )
        self.meter.ended_early = (
            "the fit ended after {steps} steps, before the timed window did "
            "(did the train_dataloader yield no batches?)"
        )
        if spec.measure.count_flops and self.meter.flop_step is None:
            trial.warnings.append(
                "flops_per_sample and mfu need measure.warmup_steps >= 1 under engine=lightning"
            )
        # With accumulation a step ends when Lightning steps the optimizer (trainer.global_step
        # moves; also at an epoch's end with fewer micro-batches): samples count up till then.
        self.accumulating = spec.accumulation_steps > 1
        self._optimizer_steps = 0
        self._step_open = False
        self.keep_first_batch = spec.measure.ceiling
        self.first_batch: Any = None
        self._compiled_steps: dict[str, Any] | None = None  # restored after the FLOP step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.begin()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, *_: Any
    ) -> None:
        if self.meter.steps == 0 and self.keep_first_batch and self.first_batch is None:
            self.first_batch = batch  # already moved to the device by Lightning
        if self._step_open:
            return  # a micro-batch inside the optimizer step
        self._step_open = True
        self.meter.step_started()
        if self.meter.counting_flops:
            # The FLOPs on the eager module, as the native engine counts them (through a
            # compiled step the counter would miss kernels).
            self._compiled_steps = use_eager_steps(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, *_: Any
    ) -> None:
        self.meter.nonfinite.update(step_loss(outputs))
        self.meter.batch_fetched(extract_batch_size(batch))
        if self.accumulating:
            if trainer.global_step == self._optimizer_steps:
                return  # a micro-batch inside the optimizer step
            self._optimizer_steps = trainer.global_step
        self._step_open = False
        if self.meter.optimizer_stepped() is not None:
            trainer.should_stop = True
        if not self.meter.counting_flops:
            self._restore_compiled_steps(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self.meter.close()
        self._restore_compiled_steps(pl_module)

    def _restore_compiled_steps(self, pl_module: pl.LightningModule) -> None:
        compiled, self._compiled_steps = self._compiled_steps, None
        for name, step in (compiled or {}).items():
            setattr(pl_module, name, step)
