"""`gpuopt.MeasureCallback` (`UserMeasureCallback`): gpuopt's measurement of a fit in the user's own
`lightning.Trainer`, no gpuopt config needed (`[lightning]` extra).

It extends the engine's meter (gpuopt.engines.lightning.meter), with data wait read by a profiler
in front of the user's own (`FetchTimer`'s `inner`). Under a multi-device strategy (however its
ranks started) every rank runs the callback and every rank's result is the job's
(gpuopt.engines._user_job).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities.data import extract_batch_size

from gpuopt.core import measured_job
from gpuopt.core.checks import measure_conf
from gpuopt.core.result import TrialResult
from gpuopt.core.spec import EngineConf, MeasureConf
from gpuopt.engines._user_job import UserLoop, job_result, loader_settings, optimizer_lr
from gpuopt.engines.lightning.meter import PEAK_MODE, FetchTimer, MeasureCallback
from gpuopt.trial import policies
from gpuopt.trial.memory import MemoryBaseline


class UserMeasureCallback(UserLoop, MeasureCallback):
    """`gpuopt.MeasureCallback`: add it to your own `Trainer` to measure your own fit the way a
    gpuopt trial is measured (no gpuopt config needed): the first step apart as compile_time_s when
    `compiled`, the warm-up, then the timed window until the stability stop, which ends the fit
    (`trainer.should_stop`). Afterwards `result` is a `TrialResult` (no compute ceiling: that
    needs a second fit). What one optimizer step trains on comes from the Trainer (the batch x
    `accumulate_grad_batches` x world size) and the learning rate from its first optimizer.

    `fit(trainer, model, ...)` runs `trainer.fit` and returns the result, never raising for a
    failing fit. Calling `trainer.fit` yourself works too: a failure then raises as usual, after
    `result` recorded it."""

    engine_name = "lightning_callback"

    def __init__(
        self, measure: MeasureConf | dict[str, Any] | str | None = None, compiled: bool = False
    ) -> None:
        self.measure = measure_conf(measure)
        self.compiled = compiled
        self._user_profiler: Profiler | None = None
        self._micro_batch: int | None = None
        self._lr: float | None = None
        self._job_ended = False
        self._returns_result = False  # fit() called: its caller reads the result
        self._observed: dict[str, Any] = {}  # what the fit ran with (batch size, workers, ...)

    def fit(self, trainer: pl.Trainer, model: pl.LightningModule, **fit_kwargs: Any) -> TrialResult:
        """`trainer.fit(model, **fit_kwargs)` measured; failures come back as the status (in a
        multi-rank job a failing rank raises `RankFailed` instead)."""
        self._returns_result = True  # the caller gets the result: the job goes on after the fit
        return self.run(lambda: trainer.fit(model, **fit_kwargs), int(trainer.world_size))

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
        memory = MemoryBaseline.take(device)
        # The strategy's process group is up by now (Lightning's setup_environment runs first).
        trial = self.start_trial(device, PEAK_MODE.get(precision, "fp32"), compile_mode, engine)
        timer = FetchTimer(device, trainer.profiler)
        cache_policy = policies.CachePolicy(trial.spec.cache, device)
        MeasureCallback.__init__(self, trial, timer, cache_policy, memory, self.ranks)
        self.result = None
        self._micro_batch = self._lr = None
        self._user_profiler = trainer.profiler
        trainer.profiler = timer

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._lr = optimizer_lr(trainer.optimizers[0] if trainer.optimizers else None)
        super().on_train_start(trainer, *args)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._micro_batch is None:
            self._micro_batch = extract_batch_size(args[1])
        super().on_train_batch_start(trainer, *args)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        if self.meter.window is not None and self._ends_job(trainer):
            self._finish(trainer)  # now, not after the epoch (`min_epochs`) and validation

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        if self.meter is not None:
            super().on_exception(trainer, pl_module, exception)
            if isinstance(exception, Exception):
                self.result = self.failed(exception)
        self._restore_profiler(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.meter is not None:
            self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        """The fit's result (once), written into the Hydra job's run directory (rank 0), where a
        sweep reads it whatever the app's task returns; in a sweep's one-process trial the job
        then ends (`TrialMeasured`: the rest of the fit, validation and test do not run)."""
        self._restore_profiler(trainer)
        if self.result is None:
            self.result = self.measured(lambda: self._record_training(trainer))
            if self.result.ok:  # every rank got here: the job's one result (a collective)
                self.result = job_result(self.result, self.ranks, self.started)
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

    def _record_training(self, trainer: pl.Trainer) -> None:
        """The Trainer's global batch (batch x accumulate_grad_batches x world size) and lr."""
        accumulate = int(trainer.accumulate_grad_batches)
        self.record_batch(self._micro_batch, accumulate, int(trainer.world_size), self._lr)
        self._observed = {
            "precision": str(trainer.precision),
            "accumulate_grad_batches": accumulate,
        }
        loader = trainer.train_dataloader
        if isinstance(loader, torch.utils.data.DataLoader):
            self._observed.update(loader_settings(loader))

    def _restore_profiler(self, trainer: pl.Trainer) -> None:
        if self._user_profiler is not None:
            trainer.profiler, self._user_profiler = self._user_profiler, None

    def described(self) -> dict[str, Any]:
        assert self.trial is not None
        precision = {"lightning": self.trial.spec.engine.precision}
        return {"precision": precision, "observed": self._observed}
