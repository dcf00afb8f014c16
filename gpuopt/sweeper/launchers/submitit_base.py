"""What gpuopt's two submitit launchers (fresh_process, slurm) share: `TrialJobLauncher`, which
keeps hydra-submitit-launcher's pickled job and makes each job one trial whose failure is a result
(gpuopt.sweeper.launchers.results). Each launcher holds only what differs: what its trial process
sets up first (`in_trial`), how it submits and collects a batch (`run_batch`), how it stops one.

Hydra imports this module on every run (plugin discovery): no submitit, optuna or torch at import.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

from gpuopt.core.lifeline import terminate_as_interrupt
from gpuopt.core.secrets import masked_singleton_state
from gpuopt.sweeper.launchers import main_task
from gpuopt.sweeper.launchers.results import (
    TrialProcessError,
    failed_return,
    log_excerpt,
    with_traceback,
)

log = logging.getLogger(__name__)


def register(node: type, *names: str) -> None:
    """`hydra/launcher=<name>` in any app, for each name (gpuopt's own conf/hydra/launcher/ files,
    first on its search path, compose the same node)."""
    for name in names:
        ConfigStore.instance().store(
            group="hydra/launcher", name=name, node=node, provider="gpuopt"
        )


def positive_seconds(key: str, value: Any) -> float:
    """A launcher's seconds setting, checked: `hydra.launcher.<key>` must be > 0."""
    if not value or float(value) <= 0:
        raise ValueError(f"hydra.launcher.{key}={value!r}; allowed: seconds > 0")
    return float(value)


def resultless(job: Any, overrides: list[str], reason: str) -> JobReturn:
    """A FAILED JobReturn for a job that ended (or was ended) without a result: `reason` with the
    head and tail of its stderr log."""
    error = TrialProcessError(reason, log_excerpt(job.paths.stderr), str(job.paths.stderr))
    return failed_return(overrides, error)


@dataclass(frozen=True)
class TrialJob:
    """One trial job of a batch: its overrides and Hydra's job number."""

    overrides: list[str]
    number: int

    def args(self) -> tuple[Any, ...]:
        """The job's call of the launcher: the stock arguments, the sweep's secrets masked."""
        state = masked_singleton_state(Singleton.get_state())
        return (self.overrides, "hydra.sweep.dir", self.number, f"job_id_for_{self.number}", state)


class TrialJobLauncher(BaseSubmititLauncher):
    """hydra-submitit-launcher's launcher with one result per trial."""

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        # A task of the main script is found again by name in the trial process, not pickled by
        # value with the script's classes (gpuopt.sweeper.launchers.main_task).
        super().setup(
            hydra_context=hydra_context,
            task_function=main_task.for_main(task_function),
            config=config,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        # Runs in the trial process: a segfault or abort leaves a Python traceback in its stderr.
        import faulthandler

        faulthandler.enable()
        self.in_trial()
        return with_traceback(super().__call__(*args, **kwargs))

    def in_trial(self) -> None:
        """What the trial process sets up before its task runs."""

    def trial_config(self, trial: TrialJob) -> Any:
        """The trial's composed config, as its job will compose it (None if it does not compose:
        the job then fails with Hydra's own error)."""
        assert self.hydra_context is not None and self.config is not None
        try:
            return self.hydra_context.config_loader.load_sweep_config(
                self.config, list(trial.overrides)
            )
        except Exception:
            return None

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.config is not None and len(job_overrides) > 0
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        jobs = [TrialJob(list(o), initial_job_idx + k) for k, o in enumerate(job_overrides)]
        for job in jobs:
            log.info(f"\t#{job.number} : {' '.join(filter_overrides(job.overrides))}")
        started: list[Any] = []
        try:
            with terminate_as_interrupt():
                return self.run_batch(jobs, started)
        except BaseException:
            # Ctrl-C or SIGTERM: the jobs run in sessions (or on nodes) of their own, so no signal
            # reaches them; without this they would go on (and hold a GPU) after the sweep is gone.
            self.stop(started)
            raise

    def run_batch(self, jobs: list[TrialJob], started: list[Any]) -> list[JobReturn]:
        """Submit `jobs` (each submitted one appended to `started`); their returns, in order."""
        raise NotImplementedError

    def stop(self, started: list[Any]) -> None:
        """End the jobs `started` that still run (Ctrl-C or SIGTERM of the sweep)."""
        raise NotImplementedError
