"""The profiled window under `engine=lightning` (gpuopt.trial.profiled_window): a short extra fit of
the fitted module, after the timed window, with Lightning's own profiler hook naming the phases
(`span_of`).

Lightning fetches the next batch before `on_train_batch_start`, so a step's span runs from the
previous step's end to this step's end: Lightning's per-step work (hooks, callbacks) is in `other`.
The fit restarts the loader (its workers too): `profile.warmup_steps` absorb the first batches. In
a distributed trial every rank fits the same steps (each step's gradient reduction is a
collective), the recorded ones after a barrier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.profilers import Profiler

from gpuopt.engines._distributed import Ranks
from gpuopt.trial.context import Trial
from gpuopt.trial.profiled_window import (
    ProfiledSteps,
    ProfileSummary,
    steps_within_budget,
    summarize,
    trace_file,
)
from gpuopt.trial.trace import SPAN_PREFIX


def span_of(action: str) -> str | None:
    """gpuopt's span for one of Lightning's profiler actions, or None when it is no phase
    (`optimizer_step`'s self time: the closure's training_step and backward are spans of their own)."""
    if action.endswith("train_dataloader_next"):
        return "next_batch"
    if action.startswith("[Strategy]"):
        for suffix, span in (
            (".batch_to_device", "h2d_copy"),
            (".training_step", "forward"),
            (".backward", "backward"),
        ):
            if action.endswith(suffix):
                return span
    if action.startswith("[LightningModule]") and action.endswith(".optimizer_step"):
        return "optimizer"
    return None


class PhaseSpans(Profiler):
    """Lightning's profiler hook: the phase actions as record_function spans while `active`."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self._open: dict[str, list[Any]] = {}

    def start(self, action_name: str) -> None:
        from torch.profiler import record_function

        span = span_of(action_name)
        if self.active and span is not None:
            context = record_function(SPAN_PREFIX + span)
            context.__enter__()
            self._open.setdefault(action_name, []).append(context)

    def stop(self, action_name: str) -> None:
        stack = self._open.get(action_name)
        if stack:
            stack.pop().__exit__(None, None, None)

    def summary(self) -> str:
        return ""


class ProfileWindow(pl.Callback):
    """Drives `ProfiledSteps` from the fit's hooks and ends the fit after its last optimizer step
    (a batch end where `trainer.global_step` moved)."""

    def __init__(self, steps: ProfiledSteps, spans: PhaseSpans) -> None:
        self.steps, self.spans = steps, spans
        self._global_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._global_step = trainer.global_step  # 0 for a new Trainer: read, not assumed
        self.steps.begin()
        self.spans.active = True
        self.steps.step_started()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if self.steps.finished or trainer.global_step == self._global_step:
            return
        self._global_step = trainer.global_step
        if self.steps.step_ended():
            self.spans.active = False
            trainer.should_stop = True
        else:
            self.steps.step_started()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exc: Any) -> None:
        self.spans.active = False
        self.steps.close()


def profiled_fit(
    trial: Trial,
    module: pl.LightningModule,
    fit_data: dict[str, Any],
    trainer_for: Callable[[list[pl.Callback], Profiler], pl.Trainer],
    ranks: Ranks | None = None,
) -> ProfileSummary:
    """Fit the fitted `module` for profile.warmup_steps + profile.steps more optimizer steps under
    torch.profiler; `trainer_for(callbacks, profiler)` builds the trainer as the engine does."""
    began = time.perf_counter()
    conf = trial.spec.profile
    if ranks is None:  # ranks profile the same steps: their own step times could disagree
        conf = steps_within_budget(conf, trial.metrics.step_time_ms)
    rank = ranks.rank if ranks is not None else None
    align = ranks.barrier if ranks is not None else None
    steps = ProfiledSteps(trial.device, conf, trace_file(None, rank), align=align)
    spans = PhaseSpans()
    trainer = trainer_for([ProfileWindow(steps, spans)], spans)
    try:
        trainer.fit(module, **fit_data)
    finally:
        steps.close()
    if not steps.finished:
        raise RuntimeError(
            f"the profiling fit ended after {steps.index} of {steps.total} steps "
            "(did the train_dataloader run out of batches?)"
        )
    return summarize(steps, began, comm=ranks is not None)
