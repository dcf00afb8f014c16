"""The one timed window of every engine: a push-style meter. Whoever owns the training loop (gpuopt's
native loop, `measure_step`'s, Lightning's, the HF Trainer's, an app's own under `MeasureJob`) tells
it what happened (`begin`, `step_started`, `fetch_started` / `batch_fetched`, `optimizer_stepped`:
the stop rule's verdict once the window is over, then the loop must stop), and the meter does the
rest alike for all of them.

The phases, in steps: one compile step when compile is on, the warm-up steps (the first under
FlopCounterMode for MFU), then the timed window until `StopRule` ends it. On CUDA the clocks are
events: the host never synchronizes inside the window. In a rank of a multi-rank trial or job the
window starts at a barrier and rank 0's verdict is broadcast (`Ranks.align`), so every rank stops
after the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuopt.core.host import cpu_ticks, steal_percent
from gpuopt.engines._window import InputWait, WindowMonitors, record_flops, record_window
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
    from gpuopt.engines._batches import BatchFeed
    from gpuopt.engines._distributed import Ranks
    from gpuopt.trial.context import Trial


class WindowMeter:
    """One trial's window over a loop that pushes its events. `wait`: the loop's own `InputWait`
    when it marks spans itself; `after_step(i)`: run after the window's i-th step (the cache
    policy); `count_flops`: False where the engine counted them itself, on an eager forward."""

    # The error of a loop that ended before the window did.
    ended_early = (
        "the training ended after {steps} optimizer steps, before the timed window did: give it "
        "more steps (max_steps, epochs) or measure=quick"
    )

    def __init__(
        self,
        trial: Trial,
        ranks: Ranks | None = None,
        *,
        wait: InputWait | None = None,
        memory: MemoryBaseline | None = None,
        after_step: Callable[[int], None] | None = None,
        count_flops: bool = True,
        precision_mode: str | None = None,
    ) -> None:
        spec, device = trial.spec, trial.device
        self.trial, self.device, self.ranks = trial, device, ranks
        self.precision_mode = precision_mode or spec.precision.mode
        self.memory = memory or MemoryBaseline.take(device)
        self.wait = wait or InputWait(device)
        self.wait.active = False
        self.after_step = after_step
        self.monitors = WindowMonitors(device, spec.measure.nvml_interval_s, trial.warnings)
        self.rule: Any = StopRule.from_measure(spec.measure)
        self.clock: Any = make_clock(device)
        if ranks is not None:
            self.rule = ranks.align(self.rule)
        self.compile_steps = 0 if spec.compile.mode == "off" else 1
        self.untimed = self.compile_steps + spec.measure.warmup_steps
        counting = count_flops and spec.measure.count_flops and spec.measure.warmup_steps >= 1
        self.flop_step: int | None = self.compile_steps if counting else None
        self.nonfinite = NonFiniteLoss()
        self.steps = self.timed_steps = self.timed_samples = 0
        self.pending = 0  # samples fetched for the optimizer step in progress
        self.window: WindowResult | None = None
        self.nvml: Any = None
        self._flops: Any = None
        self._begun = self.timing = False  # timing: inside the window
        self._t0 = self._window_t0 = time.perf_counter()
        self._first_step_at = 0.0
        self._next_check = 0
        self._ticks: dict[str, int] | None = None

    @property
    def counting_flops(self) -> bool:
        """This step runs under FlopCounterMode (an engine may run its eager step meanwhile)."""
        return self._flops is not None

    def begin(self) -> None:
        """The loop starts: the warm-up's clock (and, with no untimed step, the window)."""
        if self._begun:
            return
        self._begun = True
        self._t0 = time.perf_counter()
        self.trial.metrics.compile_time_s = 0.0 if not self.compile_steps else None
        if self.untimed == 0:
            self._start_window()

    def step_started(self) -> None:
        self.begin()
        if self.steps == 0 and self.compile_steps:
            self._t0 = time.perf_counter()  # compile time: the first step's own, not the loader's
        if self.steps == self.flop_step and self._flops is None:
            self._flops = step_flop_counter()
            self._flops.__enter__()

    def fetch_started(self) -> None:
        self.wait.fetch_started()

    def batch_fetched(self, samples: int) -> None:
        """A batch of `samples` for the current optimizer step (unmarked spans end here)."""
        self.wait.fetch_ended()
        self.wait.copy_ended()
        self.pending += samples

    def optimizer_stepped(self, samples: int | None = None) -> str | None:
        """An optimizer step ended, of `samples` (default: what `batch_fetched` counted)."""
        if samples is None:
            samples = self.pending
        self.pending = 0
        self.steps += 1
        if self._flops is not None:
            self._end_flop_step(samples)
        if self.timing:
            return self._timed_step(samples)
        if self.window is not None:
            return self.window.stop_reason
        if self.steps == self.compile_steps:
            synchronize(self.device)
            self.trial.metrics.compile_time_s = time.perf_counter() - self._t0
            self.memory.release_cache()  # the compile step's cached blocks go back
            self._t0 = time.perf_counter()
        if self.steps == self.untimed:
            synchronize(self.device)
            self.trial.metrics.warmup_time_s = time.perf_counter() - self._t0
            self.nonfinite.check("warm-up")
            self._start_window()
        return None

    def close(self) -> None:
        """After a failure: the FLOP counter and the monitors closed (more than once is fine)."""
        if self._flops is not None:
            self._flops.__exit__(None, None, None)
            self._flops = None
        self.timing = self.wait.active = False
        self.monitors.stop()

    def run(self, step: Callable[[], int], until: str = "window") -> None:
        """A loop gpuopt owns: `step()` (one optimizer step; its samples) pushed until the
        warm-up is over (`until="warmup"`) or the window is (`"window"`)."""
        self.begin()
        while not (self.window is not None or (until == "warmup" and self.timing)):
            self.step_started()
            self.optimizer_stepped(step())

    def measure(
        self,
        feed: BatchFeed,
        train: Callable[[], Any],
        check_finite: Callable[[str], None],
        process_t0: float,
    ) -> None:
        """A loop gpuopt owns (the native engine's, `measure_step`'s): `train()` (one optimizer
        step on `feed`'s batches) through the warm-up and the window, each a phase, the loop's own
        `check_finite(phase)` after each, then the window's metrics."""

        def step() -> int:
            before = feed.samples
            train()
            return feed.samples - before

        try:
            with self.trial.phase("warmup"):
                self.memory.release_cache()  # the FLOP count's
                self.run(step, until="warmup")
                check_finite("warm-up")
            with self.trial.phase("window"):
                self.run(step)
        finally:
            self.close()  # the monitors stopped, on a failure too
        with self.trial.phase("window"):
            self.record(process_t0)
            check_finite("the timed window")

    def _end_flop_step(self, samples: int) -> None:
        counter, self._flops = self._flops, None
        counter.__exit__(None, None, None)
        record_flops(self.trial, counter.step_flops(), samples, self.precision_mode)
        self.memory.release_cache()

    def _start_window(self) -> None:
        self.memory.window_starting()
        self.monitors.start()
        self.wait.reset()
        self._ticks = cpu_ticks()
        self.timing = self.wait.active = True
        if self.ranks is not None:
            self.ranks.barrier()  # every rank's window starts together
        self.clock.start()
        self._next_check = self.rule.min_steps
        self._first_step_at = time.time()
        self._window_t0 = time.perf_counter()

    def _timed_step(self, samples: int) -> str | None:
        self.clock.mark()
        if self.after_step is not None:
            self.after_step(self.timed_steps)
        self.timed_steps += 1
        self.timed_samples += samples
        reason = self._check(time.perf_counter() - self._window_t0)
        if reason is not None:
            self._end_window(reason)
        return reason

    def _check(self, elapsed: float) -> str | None:
        """The rule on `next_stop_check`'s schedule (step counts: alike on every rank), and at
        every step once its time budget or max_steps could end the window. The CI read is the
        rule's one costly part (on CUDA it queries events)."""
        rule, steps = self.rule, self.timed_steps
        due = steps >= self._next_check
        if not (due or elapsed >= rule.time_budget_s or steps >= rule.max_steps):
            return None
        if due:
            self._next_check = next_stop_check(steps)
        return rule.check(self.clock.completed_step_times(), elapsed, steps)

    def _end_window(self, reason: str) -> None:
        step_times, wall = self.clock.finish()  # synchronizes on CUDA
        self.timing = self.wait.active = False  # no span closes after the closing sync
        self.nvml = self.monitors.stop()
        steal = steal_percent(self._ticks, cpu_ticks())
        self.window = WindowResult(
            step_times, wall, self.timed_steps, reason, self._first_step_at, steal_pct=steal
        )
        self.nonfinite.check("the timed window")

    def record(self, process_t0: float) -> None:
        """The window's metrics into the trial (an error if the loop ended before it did)."""
        if self.window is None:
            raise RuntimeError(self.ended_early.format(steps=self.steps))
        record_window(
            self.trial.metrics,
            self.window,
            self.timed_samples,
            self.wait.totals(),
            self.device,
            self.nvml,
            self.memory,
            self.precision_mode,
            process_t0,
        )
        unmeasured = self.memory.unmeasured()
        if unmeasured and unmeasured not in self.trial.warnings:
            self.trial.warnings.append(unmeasured)
