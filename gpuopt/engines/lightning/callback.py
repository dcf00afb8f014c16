"""`gpuopt.MeasureCallback` (`UserMeasureCallback`): gpuopt's measurement of a fit in the user's own
`lightning.Trainer`, no gpuopt config needed (`[lightning]` extra).

It wraps the engine's meter (gpuopt.engines.lightning.meter), with data wait read by a profiler
beside the user's own (`_TeeProfiler`). Under a multi-device strategy (however its ranks started)
every rank runs the callback and every rank's result is the job's (gpuopt.engines._user_job).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.data import extract_batch_size

from gpuopt.core import measured_job
from gpuopt.core.checks import measure_conf
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.core.spec import EngineConf, MeasureConf
from gpuopt.engines._lifecycle import measured_result, measuring_spec, process_start_time, release
from gpuopt.engines._user_job import RankFailed, job_result, optimizer_lr, user_ranks
from gpuopt.engines.lightning.meter import FetchTimer, MeasureCallback, record_fit
from gpuopt.engines.lightning.precision import PEAK_MODE
from gpuopt.trial import policies
from gpuopt.trial.context import Trial
from gpuopt.trial.failures import classify_failure
from gpuopt.trial.memory import MemoryBaseline


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
    `compiled`, the warm-up, then the timed window until the stability stop, which ends the fit
    (`trainer.should_stop`). Afterwards `result` is a `TrialResult` (no compute ceiling: that
    needs a second fit). What one optimizer step trains on comes from the Trainer (the batch x
    `accumulate_grad_batches` x world size) and the learning rate from its first optimizer.

    `fit(trainer, model, ...)` runs `trainer.fit` and returns the result, never raising for a
    failing fit. Calling `trainer.fit` yourself works too: a failure then raises as usual, after
    `result` recorded it."""

    def __init__(
        self, measure: MeasureConf | dict[str, Any] | str | None = None, compiled: bool = False
    ) -> None:
        self.measure = measure_conf(measure)
        self.compiled = compiled
        self.result: TrialResult | None = None
        self._meter: MeasureCallback | None = None
        self._trial: Trial | None = None
        self._user_profiler: Profiler | None = None
        self._micro_batch: int | None = None
        self._lr: float | None = None
        self._ranks: Any = None  # gpuopt.engines._distributed.Ranks under a multi-device strategy
        self._started = time.time()
        self._job_ended = False
        self._returns_result = False  # fit() called: its caller reads the result
        self._observed: dict[str, Any] = {}  # what the fit ran with (batch size, workers, ...)

    def fit(self, trainer: pl.Trainer, model: pl.LightningModule, **fit_kwargs: Any) -> TrialResult:
        """`trainer.fit(model, **fit_kwargs)` measured; failures come back as the status (in a
        multi-rank job a failing rank raises `RankFailed` instead)."""
        self._returns_result = True  # the caller gets the result: the job goes on after the fit
        try:
            trainer.fit(model, **fit_kwargs)
        except Exception as exc:
            if self.result is None or self.result.ok:
                self.result = self._failed(exc)
        assert self.result is not None
        if not self.result.ok and int(trainer.world_size) > 1:
            raise RankFailed(self.result)
        return self.result

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        device, precision = trainer.strategy.root_device, str(trainer.precision)
        # A timed step is an optimizer step: the spec carries accumulate_grad_batches.
        engine = EngineConf(
            name="lightning",
            precision=precision,
            accumulate_grad_batches=int(trainer.accumulate_grad_batches),
        )
        compile_mode = "default" if self.compiled else "off"
        peak = PEAK_MODE.get(precision, "fp32")
        spec = measuring_spec(device, self.measure, engine, peak, compile_mode)
        self._trial = Trial(spec, device)
        memory = MemoryBaseline.take(device)
        self._process_t0 = process_start_time() or time.time()
        self._started = time.time()
        timer = FetchTimer(device)
        cache_policy = policies.CachePolicy(spec.cache, device)
        # The strategy's process group is up by now (Lightning's setup_environment runs first).
        self._ranks = user_ranks(device)
        self._meter = MeasureCallback(self._trial, timer, cache_policy, memory, self._ranks)
        self.result = None
        self._micro_batch = self._lr = None
        self._user_profiler = trainer.profiler
        trainer.profiler = _TeeProfiler(trainer.profiler, timer)

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lr = optimizer_lr(trainer.optimizers[0] if trainer.optimizers else None)
        if self._meter is not None:
            self._meter.on_train_start(trainer, *args)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._micro_batch is None:
            self._micro_batch = extract_batch_size(args[1])
        if self._meter is not None:
            self._meter.on_train_batch_start(trainer, *args)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._meter is not None:
            self._meter.on_train_batch_end(trainer, *args)
            if self._meter.meter.window is not None and self._ends_job(trainer):
                self._finish(trainer)  # now, not after the epoch (`min_epochs`) and validation

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        if self._meter is not None:
            self._meter.on_exception(trainer, pl_module, exception)
            if isinstance(exception, Exception):
                self.result = self._failed(exception)
        self._restore_profiler(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._meter is None or self._trial is None:
            return
        self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        """The fit's result (once), written into the Hydra job's run directory (rank 0), where a
        sweep reads it whatever the app's task returns; in a sweep's one-process trial the job
        then ends (`TrialMeasured`: the rest of the fit, validation and test do not run)."""
        assert self._meter is not None and self._trial is not None
        self._restore_profiler(trainer)
        if self.result is None:
            try:
                record_fit(self._meter, self._process_t0)
                self._record_training(trainer, self._trial.metrics)
                self.result = self._finished(Status.OK, None)
            except Exception as exc:
                self.result = self._failed(exc)
            if self.result.ok:  # every rank got here: the job's one result (a collective)
                self.result = job_result(self.result, self._ranks, self._started)
            if int(trainer.global_rank) == 0:
                measured_job.write(self.result)
        if self._ends_job(trainer) and not self._job_ended:
            self._job_ended = True  # once: Lightning's teardown after the raise comes back here
            raise measured_job.TrialMeasured("measured: gpuopt's sweep trial ends the job here")

    def _ends_job(self, trainer: pl.Trainer) -> bool:
        """In a gpuopt sweep's trial of one process, where the callback is listed in the app's
        config (`fit()`'s caller gets the result and goes on; a multi-rank job's ranks end their
        fit together, and the app's code after the fit runs)."""
        one_process = int(trainer.world_size) == 1
        return measured_job.in_sweep_trial() and one_process and not self._returns_result

    def _record_training(self, trainer: pl.Trainer, m: Metrics) -> None:
        """The Trainer's global batch (batch x accumulate_grad_batches x world size) and lr."""
        accumulate = int(trainer.accumulate_grad_batches)
        m.micro_batch, m.accumulation_steps, m.lr = self._micro_batch, accumulate, self._lr
        if self._micro_batch is not None:
            m.global_batch = self._micro_batch * accumulate * int(trainer.world_size)
        self._observed = {
            "precision": str(trainer.precision),
            "accumulate_grad_batches": accumulate,
        }
        loader = trainer.train_dataloader
        if isinstance(loader, torch.utils.data.DataLoader):  # what gpuopt.core.search_space traces
            self._observed.update(
                batch_size=loader.batch_size,
                num_workers=loader.num_workers,
                pin_memory=loader.pin_memory,
                prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
                persistent_workers=loader.persistent_workers,
            )

    def _restore_profiler(self, trainer: pl.Trainer) -> None:
        if self._user_profiler is not None:
            trainer.profiler, self._user_profiler = self._user_profiler, None

    def _failed(self, exc: Exception) -> TrialResult:
        status, reason = classify_failure(exc)
        if status is Status.OOM and self._trial is not None:
            release(self._trial, status)
        return self._finished(status, reason)

    def _finished(self, status: Status, reason: str | None) -> TrialResult:
        trial = self._trial
        assert trial is not None
        config = {
            "engine": {"name": "lightning_callback"},
            "measure": dataclasses.asdict(self.measure),
            "precision": {"lightning": trial.spec.engine.precision},
            "observed": self._observed,
        }
        return measured_result(trial, status, reason, config)
