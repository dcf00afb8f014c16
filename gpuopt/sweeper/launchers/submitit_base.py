"""What gpuopt's two submitit launchers (fresh_process, slurm) share: `TrialJobLauncher`, which
keeps hydra-submitit-launcher's pickled job and makes each job one trial whose failure is a result.

Hydra imports this module on every run (plugin discovery): no submitit, optuna or torch at import.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

from gpuopt.core import measured_job, rank_files
from gpuopt.core.errors import ConfigError
from gpuopt.core.lifeline import terminate_as_interrupt
from gpuopt.core.result import TrialResult
from gpuopt.core.secrets import masked_singleton_state
from gpuopt.sweeper.launchers import main_task, trial_task
from gpuopt.sweeper.launchers.results import (
    TrialProcessError,
    attach_diagnostics,
    failed_return,
    job_return,
    log_excerpt,
    with_traceback,
)

log = logging.getLogger(__name__)


def register(node: type, *names: str) -> None:
    """`hydra/launcher=<name>` in any app, for each name."""
    for name in names:
        ConfigStore.instance().store(
            group="hydra/launcher", name=name, node=node, provider="gpuopt"
        )


def positive(key: str, value: Any, integer: bool = False) -> Any:
    """`hydra.launcher.<key>` checked: seconds > 0 (a float), or an integer >= 1 (a ConfigError
    before anything is created)."""
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        raise ConfigError(
            f"hydra.launcher.{key}", value, "an integer >= 1" if integer else "seconds > 0"
        )
    return value if integer else float(value)


def resultless(job: Any, overrides: list[str], reason: str, run_dir: str | None) -> JobReturn:
    """The JobReturn of a job that ended without a result: what its measuring callback
    (core/measured_job) or the rank that failed first (core/rank_files) wrote into `run_dir`, then
    `reason` (a launcher such as Lightning's kills the trial once a rank failed); else a FAILED
    return: `reason` with the head and tail of its stderr log."""
    folder = Path(run_dir) if run_dir else None
    result = measured_job.read(folder) if folder else None
    first = rank_files.first_failure(folder / rank_files.RANKS_FOLDER) if folder else None
    if result is None and first is not None:
        result = TrialResult(first.status, reason=first.text)
    if result is None:
        return failed_return(overrides, TrialProcessError(reason, log_excerpt(job.paths.stderr)))
    if not result.ok:
        result.reason = f"{result.reason} (then the trial process: {reason})"
    ret = JobReturn(overrides=overrides, status=JobStatus.COMPLETED)  # as if the task returned it
    ret.return_value = result
    return ret


@dataclass
class TrialJob:
    overrides: list[str]
    number: int
    slot: int  # its place in the batch
    job: Any = None  # the submitit job, once submitted
    devices: str | None = None  # CUDA_VISIBLE_DEVICES it was given (fresh_process)
    seen_end: float | None = None  # when SLURM was first seen to have ended it

    def args(self) -> tuple[Any, ...]:
        """The stock arguments of the launcher's call, the sweep's secrets masked."""
        state = masked_singleton_state(Singleton.get_state())
        return (self.overrides, "hydra.sweep.dir", self.number, f"job_id_for_{self.number}", state)


class TrialJobLauncher(BaseSubmititLauncher):
    """hydra-submitit-launcher's launcher with one result per trial."""

    ranks = trial_task.RankPlan()  # how a trial's ranks start (`hydra.launcher.nproc_per_node`)
    tick_s = 0.05  # seconds between two looks at the batch's jobs

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from omegaconf import OmegaConf

        n = self.ranks.nproc_per_node
        if n > 1 and OmegaConf.select(config, "hydra.sweeper.gpuopt_task"):
            raise ConfigError(  # each rank would run a whole single-process trial of its own
                "hydra.launcher.nproc_per_node",
                n,
                "1 for gpuopt's own app (distributed=ddp distributed.nproc_per_node=N starts ranks)",
            )
        task = trial_task.TrialTask(
            main_task.for_main(task_function), trial_task.entry_args(), self.ranks
        )
        super().setup(hydra_context=hydra_context, task_function=task, config=config)

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        # Runs in the trial process: a segfault or abort leaves a Python traceback in its stderr.
        import faulthandler

        faulthandler.enable()
        self.in_trial()
        return with_traceback(super().__call__(*args, **kwargs))

    def in_trial(self) -> None:
        """What the trial process sets up before its task runs."""

    def run_dir_of(self, trial: TrialJob) -> str | None:
        """The job's output dir as Hydra's run_job derives it; None when it cannot be told here."""
        from omegaconf import OmegaConf, open_dict

        try:
            cfg = self.trial_config(trial)
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num = trial.number
            sweep_dir = str(OmegaConf.select(cfg, "hydra.sweep.dir"))
            return str(Path(sweep_dir) / str(OmegaConf.select(cfg, "hydra.sweep.subdir")))
        except Exception:  # no config (None), or no sweep dir in it
            return None

    def trial_config(self, trial: TrialJob) -> Any:
        """The trial's composed config (None if it does not compose: the job then fails with
        Hydra's own error)."""
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
        jobs = [TrialJob(list(o), initial_job_idx + k, k) for k, o in enumerate(job_overrides)]
        for job in jobs:
            log.info(f"\t#{job.number} : {' '.join(filter_overrides(job.overrides))}")
        started: list[Any] = []
        try:
            with terminate_as_interrupt():
                self.submit(jobs, started)
                return self.collect(jobs)
        except BaseException:
            # Ctrl-C or SIGTERM: the jobs run in sessions (or on nodes) of their own, so no signal
            # reaches them; without this they would go on (and hold a GPU) after the sweep is gone.
            self.stop(started)
            raise

    def collect(self, trials: list[TrialJob]) -> list[JobReturn]:
        """Each trial's JobReturn, in order, once it has a result or `ended` says why it has none;
        its diagnostics attached."""
        batch: dict[str, Any] = {"t0": time.monotonic()}  # the launcher's notes on the batch
        run_dirs = [self.run_dir_of(trial) for trial in trials]
        returns: dict[int, JobReturn] = {}
        while len(returns) < len(trials):
            waiting = [t for t in trials if t.slot not in returns]
            reasons = self.ended([t for t in waiting if not self.has_result(t.job)], batch)
            for trial in waiting:
                job, run_dir = trial.job, run_dirs[trial.slot]
                if self.has_result(job):  # also one that came since `ended` looked
                    ret = job_return(job, trial.overrides)
                elif trial.slot in reasons:
                    ret = resultless(job, trial.overrides, reasons[trial.slot], run_dir)
                else:
                    continue
                ret.gpuopt_visible_devices = trial.devices  # type: ignore[attr-defined]
                attach_diagnostics(ret, job, run_dir)
                returns[trial.slot] = ret
            if len(returns) < len(trials):
                time.sleep(self.tick_s)
        return [returns[k] for k in range(len(trials))]

    @staticmethod
    def has_result(job: Any) -> bool:
        return bool(job.paths.result_pickle.exists())

    def submit(self, trials: list[TrialJob], started: list[Any]) -> None:
        """Submit each trial (`trial.job`), appending each submitted job to `started`."""
        raise NotImplementedError

    def ended(self, waiting: list[TrialJob], batch: dict[str, Any]) -> dict[int, str]:
        """slot -> why the job ended without a result, for the jobs of `waiting` that ended."""
        raise NotImplementedError

    def stop(self, started: list[Any]) -> None:
        """End the jobs `started` that still run (Ctrl-C or SIGTERM of the sweep)."""
        raise NotImplementedError
