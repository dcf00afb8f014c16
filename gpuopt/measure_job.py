"""`gpuopt.MeasureJob`: a Hydra callback that measures any Hydra app's training with no change to
its code, named in YAML alone:

    hydra:
      callbacks:
        gpuopt_measure:
          _target_: gpuopt.MeasureJob
          measure: quick     # optional: default | quick | a dict of measure.* settings
          budget_s: 600      # optional: how long the job may run before its first optimizer
                             # step (null: no limit); past it, a clear status and the job ends

At the job's start it hooks torch's optimizer steps and the DataLoader iterators the job creates
(gpuopt.engines.job_meter); once the timed window stopped it writes the result into the run
directory and ends the job, where a gpuopt sweep reads it whatever the task returns. Hydra also
instantiates callbacks in a sweep's own process: importing this module imports no torch there,
and nothing is hooked outside a job.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback

from gpuopt.core import measured_job

# How long a job may run before its first optimizer step (null: no limit); past it the job ends
# with the status "not measured: no optimizer step within budget_s".
BUDGET_S = 600.0


def _budget(value: Any) -> float | None:
    """`budget_s` as given in YAML: a number of seconds > 0, or null."""
    if value is None:
        return None
    from gpuopt.core.errors import ConfigError

    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError("hydra.callbacks.gpuopt_measure.budget_s", value, "seconds > 0, or null")
    return float(value)


class MeasureJob(Callback):
    """Measures the job's own training loop (plain PyTorch, Lightning, the HF Trainer alike)."""

    def __init__(self, measure: Any = None, budget_s: float | None = BUDGET_S) -> None:
        self.measure = measure
        self.budget_s = _budget(budget_s)  # checked as Hydra instantiates the callback
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
