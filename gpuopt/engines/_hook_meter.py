"""A timed window driven from a training loop that is not gpuopt's: the loop's own hooks say where
an optimizer step ends, and this meter does the rest as gpuopt's own loop does (gpuopt.trial.measure
clocks, warm-up, one step under FlopCounterMode for MFU, the stop rule, the monitors).

Used by the Hugging Face Trainer's callback (gpuopt.engines.hf_trainer), whose loop fetches every
micro-batch of an optimizer step at once and calls back at the step's start and end. The
Lightning meter (gpuopt.engines.lightning.meter) keeps its own copy of this logic for Lightning's
hooks and profiler.

In a multi-rank job (`ranks`: the user's process group, gpuopt.engines._user_job) the window starts
at a barrier and the stop rule is rank 0's, read at the same step counts on every rank and
broadcast, so every rank stops after the same step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gpuopt.core.host import cpu_ticks, steal_percent
from gpuopt.engines._window import InputWait, WindowMonitors, record_window
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

if TYPE_CHECKING:
    from gpuopt.engines._distributed import Ranks
    from gpuopt.trial.context import Trial


class HookMeter:
    """One trial's window over someone else's loop: `step_started`, `samples_fetched` and
    `step_ended` from its hooks; `record` once the window ended."""

    def __init__(self, trial: Trial, ranks: Ranks | None = None) -> None:
        spec, device = trial.spec, trial.device
        self.trial, self.device = trial, device
        self.memory = MemoryBaseline.take(device)
        self.wait = InputWait(device)
        self.monitors = WindowMonitors(device, spec.measure.nvml_interval_s, trial.warnings)
        self.rule: Any = StopRule.from_measure(spec.measure)
        self.clock: Any = make_clock(device)
        self.ranks, self.aligned = ranks, ranks is not None
        if ranks is not None:
            self.clock, self.rule = ranks.align(self.clock, self.rule)
        self._next_check = self.rule.min_steps
        self.compile_steps = 0 if spec.compile.mode == "off" else 1
        self.untimed = self.compile_steps + spec.measure.warmup_steps
        counting = spec.measure.count_flops and spec.measure.warmup_steps >= 1
        self.flop_step = self.compile_steps if counting else None
        self.nonfinite = NonFiniteLoss()
        self.steps = self.timed_steps = self.timed_samples = self._pending = 0
        self.window: WindowResult | None = None
        self.nvml: Any = None
        self._flops: Any = None
        self._t0 = self._window_t0 = time.perf_counter()
        self._first_step_at = 0.0
        self._ticks: dict[str, int] | None = None
        self._window_started = False

    @property
    def timing(self) -> bool:
        """Inside the timed window."""
        return self._window_started and self.window is None

    def step_started(self) -> None:
        """An optimizer step begins: the FLOP step's counter opens."""
        if self.steps == self.flop_step and self._flops is None:
            self._flops = step_flop_counter()
            self._flops.__enter__()

    def fetch_started(self) -> None:
        if self.timing:
            self.wait.fetch_started()

    def samples_fetched(self, samples: int) -> None:
        """The loop fetched `samples` for the current optimizer step (all its micro-batches)."""
        if self.timing:
            self.wait.fetch_ended()
            self.wait.copy_ended()
        self._pending += samples

    def step_ended(self) -> str | None:
        """An optimizer step ended; the stop rule's verdict once the window is over (the loop
        must stop then), else None."""
        samples, self._pending = self._pending, 0
        self.steps += 1
        if self._flops is not None:
            self._end_flop_step(samples)
        if self.timing:
            return self._timed_step(samples)
        if self.compile_steps and self.steps == self.compile_steps:
            synchronize(self.device)
            self.trial.metrics.compile_time_s = time.perf_counter() - self._t0
            self._t0 = time.perf_counter()
        if self.steps == self.untimed:
            synchronize(self.device)
            self.trial.metrics.warmup_time_s = time.perf_counter() - self._t0
            self.nonfinite.check("warm-up")
            self._start_window()
        return None

    def _end_flop_step(self, samples: int) -> None:
        counter, self._flops = self._flops, None
        counter.__exit__(None, None, None)
        flops = counter.step_flops()
        if flops.hardware and samples:
            self.trial.metrics.flops_per_sample = flops.model / samples
            self.trial.metrics.hardware_flops_per_sample = flops.hardware / samples
        self.memory.release_cache()

    def _start_window(self) -> None:
        self.memory.window_starting()
        self.monitors.start()
        self.wait.reset()
        self._ticks = cpu_ticks()
        self._window_started = True
        self.clock.start()
        self._first_step_at = time.time()
        self._window_t0 = time.perf_counter()

    def _timed_step(self, samples: int) -> str | None:
        self.clock.mark()
        self.timed_steps += 1
        self.timed_samples += samples
        elapsed = time.perf_counter() - self._window_t0
        reason = self._check(elapsed)
        if reason is not None:
            step_times, wall = self.clock.finish()  # synchronizes on CUDA
            self.nvml = self.monitors.stop()
            steal = steal_percent(self._ticks, cpu_ticks())
            self.window = WindowResult(
                step_times, wall, self.timed_steps, reason, self._first_step_at, steal_pct=steal
            )
            self.nonfinite.check("the timed window")
        return reason

    def _check(self, elapsed: float) -> str | None:
        """The rule at step counts alone when aligned (a collective on every rank at once);
        else once a stop is possible (reading step times queries CUDA events)."""
        rule, steps = self.rule, self.timed_steps
        if self.aligned:
            due = steps >= self._next_check
            if not (due or steps >= rule.max_steps):
                return None
            if due:
                self._next_check = next_stop_check(steps)
            return rule.check(self.clock.completed_step_times(), elapsed, steps)
        if steps >= rule.min_steps or elapsed >= rule.time_budget_s:
            return rule.check(self.clock.completed_step_times(), elapsed)
        return None

    def stop(self) -> None:
        """After a failure: the FLOP counter and the monitors closed."""
        if self._flops is not None:
            self._flops.__exit__(None, None, None)
            self._flops = None
        self.monitors.stop()

    def record(self, precision_mode: str | None, process_t0: float) -> None:
        """The window's metrics into the trial (an error if the loop ended before it did)."""
        if self.window is None:
            raise RuntimeError(
                f"the training ended after {self.steps} optimizer steps, before the timed window "
                "did: give it more steps (max_steps, num_train_epochs) or measure=quick"
            )
        record_window(
            self.trial.metrics,
            self.window,
            self.timed_samples,
            self.wait.totals(),
            self.device,
            self.nvml,
            self.memory,
            precision_mode,
            process_t0,
        )
