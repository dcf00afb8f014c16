"""`gpuopt.MeasureJob`: a Hydra callback that measures any Hydra app's training with no change to
its code, named in YAML alone:

    hydra:
      callbacks:
        gpuopt_measure:
          _target_: gpuopt.MeasureJob
          measure: quick     # optional: default | quick | a dict of measure.* settings
          budget_s: 600      # optional: how long the job may run before its first optimizer
                             # step (null: no limit); past it, a clear status and the job ends

At the job's start it hooks torch's optimizer steps and DataLoader iterators
(gpuopt.engines.job_meter); once measured it writes the result into the run directory and ends
the job. Hydra also instantiates callbacks in a sweep's own process: this module imports no torch,
and nothing is hooked outside a job.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback

from gpuopt.core import measured_job

BUDGET_S = 600.0


class MeasureJob(Callback):
    """Measures the job's own training loop (plain PyTorch, Lightning, the HF Trainer alike)."""

    def __init__(self, measure: Any = None, budget_s: float | None = BUDGET_S) -> None:
        # budget_s checked as Hydra instantiates the callback
        if budget_s is not None and (
            isinstance(budget_s, bool) or not isinstance(budget_s, int | float) or budget_s <= 0
        ):
            from gpuopt.core.errors import ConfigError

            key = "hydra.callbacks.gpuopt_measure.budget_s"
            raise ConfigError(key, budget_s, "seconds > 0, or null")
        self.measure = measure
        self.budget_s = None if budget_s is None else float(budget_s)
        self._meter: Any = None

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        from gpuopt.core.checks import measure_conf
        from gpuopt.engines.job_meter import JobMeter

        measure = self.measure
        if hasattr(measure, "items"):  # a DictConfig from YAML
            measure = dict(measure.items())
        self._meter = JobMeter(measure_conf(measure), self.budget_s)
        self._meter.install()
        measured_job.at_task_end(self._meter.unmeasured)

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        if self._meter is not None:
            self._meter.unmeasured()  # a clear status when the job ended unmeasured
            self._meter = None
