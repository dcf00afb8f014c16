"""A Hydra job's own training loop measured with no change to its code (gpuopt.MeasureJob), from
torch's global mechanisms only: every optimizer's step post-hook (the first optimizer that steps
is the one timed: a GAN's second is ignored) and the `__next__` of every DataLoader iterator (the
loader that fed the first optimizer step is the training loader). It cannot see a host-to-device
copy the loop makes after `next()`, nor an autocast dtype (MFU is read against the fp32 peak).

Once the window stops, the result is written into the Hydra run directory and the job ends: in a
sweep's trial with `TrialMeasured`, in a single run with `SystemExit(0)`; both pass the app's own
`except Exception`. A job that has not stepped an optimizer `budget_s` after its start gets a
"not measured" status written, and its process ends there: the launcher reads that result, not a
timeout.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.dataloader import _BaseDataLoaderIter

from gpuopt.core import measured_job
from gpuopt.core.result import Status, TrialResult
from gpuopt.core.spec import MeasureConf
from gpuopt.engines._batches import batch_samples
from gpuopt.engines._meter import WindowMeter
from gpuopt.engines._user_job import (
    UserLoop,
    job_result,
    loader_settings,
    optimizer_lr,
    world_size,
)

log = logging.getLogger(__name__)
ENGINE_NAME = "measure_job"


class JobMeter(UserLoop):
    """The hooks of one job: install, (the job trains), then the result or a clear status."""

    engine_name = ENGINE_NAME

    def __init__(self, measure: MeasureConf, budget_s: float | None = None) -> None:
        self.measure = measure
        self.budget_s = budget_s
        self._budget: threading.Timer | None = None
        self.end_process: Callable[[int], Any] = os._exit  # tests: a stand-in
        self.optimizer: Any = None  # the first optimizer that stepped
        self.train_data: int | None = None  # id() of the training loader's dataset
        self.fetched: dict[int, int] = defaultdict(int)  # samples per dataset before step 1
        self.last_fetched: int | None = None
        self.loaders: dict[int, dict[str, Any]] = {}  # each loader's settings, by dataset
        self.step_samples: list[int] = []  # samples per optimizer step
        self.batch_sizes: list[int] = []  # samples per training batch (a micro-batch)
        self.batches = self.optimizer_steps = 0
        self.lr: float | None = None
        self._removers: list[Any] = []

    def install(self) -> None:
        handle = register_optimizer_step_post_hook(self._optimizer_stepped)
        original = _BaseDataLoaderIter.__next__
        meter = self

        def __next__(iterator: _BaseDataLoaderIter) -> Any:
            return meter._fetch(iterator, original)

        _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
        self._removers = [handle.remove, lambda: setattr(_BaseDataLoaderIter, "__next__", original)]
        if self.budget_s is not None:
            self._budget = threading.Timer(self.budget_s, self._over_budget)
            self._budget.daemon = True
            self._budget.start()

    def uninstall(self) -> None:
        self._cancel_budget()
        for remove in self._removers:
            remove()
        self._removers = []
        if self.meter is not None:
            self.meter.close()

    def _fetch(self, iterator: _BaseDataLoaderIter, original: Any) -> Any:
        dataset = id(iterator._dataset)
        counting = self.meter is not None and dataset == self.train_data
        if counting:
            self.meter.fetch_started()
        batch = original(iterator)
        self.batches += 1
        try:
            samples = batch_samples(batch)
        except TypeError:  # no tensor with a batch dimension: counted as no samples, never raised
            samples = 0
        if self.meter is None:
            self._start()
        if self.train_data is None:
            self.fetched[dataset] += samples
            self.last_fetched = dataset
            self.loaders.setdefault(dataset, loader_settings(iterator, private=True))
        elif counting:
            self.batch_sizes.append(samples)
            self.meter.batch_fetched(samples)
        return batch

    def _start(self) -> None:
        """The trial, on the device the job trains on as seen at its first batch."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        trial = self.start_trial(device)
        trial.warnings.append(
            "MFU is read against the device's fp32 peak: gpuopt.MeasureJob cannot see an autocast "
            "dtype inside the job's loop"
        )
        self.meter = WindowMeter(trial, self.ranks)
        if self.meter.flop_step is not None and self.measure.warmup_steps >= 2:
            # The second step is counted: what runs before the first optimizer step may include
            # the job's other loaders (Lightning's sanity-check validation); from one step's end
            # to the next, a loop trains.
            self.meter.flop_step = 1
        else:
            self.meter.step_started()  # the first step's forward and backward come next

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.optimizer is None:
            self._cancel_budget()  # the job trains: the window's own budget applies now
            self.optimizer = optimizer
            self.lr = optimizer_lr(optimizer)
        if optimizer is not self.optimizer or self.meter is None or self.result is not None:
            return
        self.optimizer_steps += 1
        if self.train_data is None:  # the loader that fed this first step is the training one
            self.train_data = self.last_fetched
            self.meter.batch_fetched(self.fetched.get(self.train_data, 0))
        self.step_samples.append(self.meter.pending)
        try:
            stopped = self.meter.optimizer_stepped()
        except Exception as exc:  # a NaN/inf loss at the window's end: the status
            self._finish(self.failed(exc))
            return
        if stopped is None:
            self.meter.step_started()
        else:
            self._finish(self.measured(self._record_training))

    def _finish(self, result: TrialResult) -> None:
        self.result = job_result(result, self.ranks, self.started)
        self.uninstall()
        if _leader():  # every rank holds the job's merged result: rank 0 writes it
            measured_job.write(self.result)
        if measured_job.in_sweep_trial():
            raise measured_job.TrialMeasured("measured: gpuopt.MeasureJob ends the job here")
        if not measured_job.single_run():  # a job of another launcher's multirun: it goes on
            log.info("gpuopt.MeasureJob: measured (%s)", self.result.status.value)
            return
        log.info("gpuopt.MeasureJob: measured (%s); the job ends here", self.result.status.value)
        raise SystemExit(0)

    def _record_training(self) -> None:
        metrics = self.trial.metrics  # type: ignore[union-attr]
        timed = [n for n in self.step_samples[-max(1, self.meter.timed_steps) :] if n]  # type: ignore[union-attr]
        if timed:
            per_step = int(statistics.median(timed))
            micro = int(statistics.median(self.batch_sizes)) if self.batch_sizes else per_step
            metrics.micro_batch = micro
            metrics.accumulation_steps = max(1, round(per_step / micro))
            metrics.global_batch = per_step * world_size()
        metrics.lr = self.lr

    def described(self) -> dict[str, Any]:
        return {"observed": self.loaders.get(self.train_data or -1, {})}

    def _cancel_budget(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.cancel()

    def _over_budget(self) -> None:
        """(The budget's timer thread.) Rank 0 alone of a multi-rank job: its end ends the others,
        and no other rank's end can come before its status is written."""
        if self.result is not None or self.optimizer is not None or measured_job.ranks_started():
            return
        if not _leader():
            return
        why = (
            f"no optimizer step within budget_s={self.budget_s:g} s of the job's start "
            f"({self.batches} DataLoader batches fetched); a job that trains later needs a "
            "larger budget: gpuopt.MeasureJob(budget_s=...)"
        )
        self._write_unmeasured(why)
        log.error("gpuopt.MeasureJob: %s; the job ends here", self.result.reason)  # type: ignore[union-attr]
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.end_process(1)

    def unmeasured(self) -> TrialResult | None:
        """At the job's end without a result: why (a clear status, never a crash)."""
        if self.result is not None:
            return None
        self.uninstall()
        if measured_job.ranks_started():
            return None  # this process only started the job's ranks: theirs is the status
        if self.batches == 0:
            why = "the job never iterated a DataLoader (gpuopt.MeasureJob times DataLoader batches)"
        elif self.optimizer_steps == 0:
            why = "the job never stepped a torch.optim optimizer (its step hooks saw none)"
        else:
            steps = self.optimizer_steps
            why = (
                f"the job ended after {steps} optimizer steps, before the timed window did: give "
                "it more steps (epochs) or +hydra.callbacks.gpuopt_measure.measure=quick"
            )
        return self._write_unmeasured(why)

    def _write_unmeasured(self, why: str) -> TrialResult:
        self.result = TrialResult(
            status=Status.ERROR,
            reason=f"not measured: {why}",
            config={"engine": {"name": ENGINE_NAME}},
            warnings=self.trial.warnings if self.trial is not None else [],
        )
        if _leader():
            measured_job.write(self.result)
        return self.result


def _leader() -> bool:
    return os.environ.get("RANK", "0") == "0"
