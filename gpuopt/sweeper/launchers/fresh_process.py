"""hydra/launcher=fresh_process: hydra-submitit-launcher's local mode, one result per trial.

The stock local launcher waits for a whole batch, raises when any job of it produced no result,
and its only time limit is whole minutes. This one keeps submitit (its pickled job, controller and
logs) and gives each job its own deadline (`timeout_s`: the job's whole process group killed),
records a job that ended without a result from its exit status ("killed by signal SIGSEGV"), pins
parallel jobs to their own GPU(s) (gpus.assign) and runs `nproc_per_node=N` as N ranks of one job.

Hydra imports this module on every run (plugin discovery): no submitit, optuna or torch at import.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher

from gpuopt.core import lifeline
from gpuopt.core._compat import job_process, local_controller_class, local_executor_class
from gpuopt.core.fmt import duration
from gpuopt.sweeper.launchers import gpus as gpus_mod
from gpuopt.sweeper.launchers import submitit_base as base
from gpuopt.sweeper.launchers.oom_evidence import OomWatch
from gpuopt.sweeper.launchers.results import describe_exit, fatal_error, log_tail
from gpuopt.sweeper.launchers.trial_task import RankPlan

log = logging.getLogger(__name__)
# The sweep's own lines (gpuopt.sweeper.progress, trials): a trial still running is one of them.
progress_log = logging.getLogger("gpuopt.sweeper")

EXIT_CODES_SUFFIX = "_exit_codes.json"  # written by the job's controller next to its logs
# While a trial runs, one "still running" line every this many seconds: a long trial (compile, a
# slow window) never makes the sweep look hung; a trial that ends sooner prints none.
PROGRESS_S = 10.0


@dataclass
class FreshProcessConf(LocalQueueConf):
    _target_: str = "gpuopt.sweeper.launchers.fresh_process.FreshProcessLauncher"
    # A trial still running this many seconds after its process started is killed (with its
    # DataLoader workers): an error "timed out after N s".
    timeout_s: float = 1200.0
    # n_jobs > 1: give each parallel trial its own GPU(s) through CUDA_VISIBLE_DEVICES.
    pin_gpus: bool = True
    # Shell lines run before each trial process (module loads, env vars).
    setup: list[str] | None = None
    # Each trial's task as this many ranks of one job (torch's elastic launcher, the env://
    # variables torchrun sets): for a script that calls torch.distributed.init_process_group.
    nproc_per_node: int = 1
    # Seconds the ranks of a trial may take to meet (they import torch and the script first).
    rdzv_timeout_s: float = 120.0


base.register(FreshProcessConf, "gpuopt_local", "fresh_process")  # the same launcher, two names


def _start_controller(
    folder: Path, command: str, params: dict[str, Any]
) -> subprocess.Popen[bytes]:
    """submitit's start_controller, in a new session (a timeout kills the whole tree) and with
    gpuopt's controller, which writes the tasks' exit codes."""
    setup = list(params.get("setup") or ())
    env = dict(os.environ)
    env.update(
        SUBMITIT_LOCAL_NTASKS=str(params.get("tasks_per_node", 1)),
        SUBMITIT_LOCAL_COMMAND=command,
        SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * params.get("timeout_min", 2.0))),
        SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(params.get("signal_delay_s", 30))),
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_STDERR_TO_STDOUT="1" if params.get("stderr_to_stdout") else "",
        SUBMITIT_EXECUTOR="local",
        CUDA_VISIBLE_DEVICES=",".join(str(k) for k in range(params.get("gpus_per_node") or 0)),
        SUBMITIT_LOCAL_WITH_SHELL="1" if setup else "",
    )
    cmd: Any = [sys.executable, "-m", "gpuopt.sweeper.launchers.fresh_process", str(folder)]
    if setup:
        cmd = " && ".join([*setup, shlex.join(cmd)])
    return subprocess.Popen(cmd, shell=bool(setup), env=env, start_new_session=True)


class FreshProcessLauncher(base.TrialJobLauncher, LocalLauncher):
    """submitit local mode with a per-trial deadline and per-trial failure records."""

    def __init__(
        self,
        timeout_s: float = 1200.0,
        pin_gpus: bool = True,
        nproc_per_node: int = 1,
        rdzv_timeout_s: float = 120.0,
        **params: Any,
    ) -> None:
        super().__init__(**params)
        self.timeout_s = base.positive("timeout_s", timeout_s)
        self.pin_gpus = bool(pin_gpus)
        self.ranks = RankPlan(
            base.positive("nproc_per_node", nproc_per_node, integer=True),
            base.positive("rdzv_timeout_s", rdzv_timeout_s),
        )
        # The sweeping process, pickled with each job: the trial's watchdog ends it with the sweep.
        self.sweep_process: lifeline.SweepProcess | None = None
        # Set by the sweep loop around a batch: slot -> why to stop that job now (its trial was
        # failed as stale by another worker), else None. Never pickled into a job.
        self.stop_check: Callable[[int], str | None] | None = None
        self._oom_watch = OomWatch(None, None)  # the cgroup's OOM-kill count at the batch's start

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["stop_check"] = None  # a closure over the study: stays in the sweeping process
        return state

    def in_trial(self) -> None:
        # The trial ends with its sweep and by its own deadline (gpuopt.core.lifeline).
        lifeline.guard_trial(self.sweep_process, self.timeout_s)

    def _device_plan(self, n_jobs: int) -> list[str | None]:
        """CUDA_VISIBLE_DEVICES per job of the batch (gpus.assign; None: as in this process;
        "<submitit>": submitit's own 0..gpus_per_node-1); a warning when they must share."""
        per_job = self.params.get("gpus_per_node")
        unpinned = "<submitit>" if per_job is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
        pin = self.pin_gpus and (n_jobs > 1 or per_job is not None)
        gpus = gpus_mod.pinnable_gpus(os.environ) if pin else None
        if not gpus:
            return [unpinned] * n_jobs
        warning = gpus_mod.sharing_warning(len(gpus), n_jobs, per_job)
        if warning:
            log.warning(warning)
        return [gpus_mod.assign(gpus, n_jobs, slot, per_job) for slot in range(n_jobs)]

    def submit(self, trials: list[base.TrialJob], started: list[Any]) -> None:
        """Every job submitted at once, each with its GPUs."""
        params = dict(self.params)
        # submitit's own limit (whole minutes) stays above the per-trial deadline.
        params["timeout_min"] = max(
            int(params.get("timeout_min") or 0), math.ceil(self.timeout_s / 60) + 1
        )
        executor = local_executor_class(_start_controller)(
            folder=params.pop("submitit_folder"), python=params.pop("python", None)
        )
        for key in ("max_num_timeout", "name", "mem_gb", "cpus_per_task", "nodes"):
            params.pop(key, None)  # cluster-only keys: meaningless for a local process
        user_setup = list(params.pop("setup", None) or [])
        executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
        plan = self._device_plan(len(trials))
        self.sweep_process = lifeline.SweepProcess.this()
        self._oom_watch = OomWatch.start()
        for trial, device in zip(trials, plan, strict=True):
            own = [] if device == "<submitit>" else [gpus_mod.setup_line(device)]
            executor.update_parameters(setup=[*user_setup, *own])
            trial.job = executor.submit(self, *trial.args())
            trial.devices = None if device == "<submitit>" else device
            started.append(trial.job)

    def stop(self, started: list[Any]) -> None:
        for job in started:
            self._kill(job)

    @staticmethod
    def has_result(job: Any) -> bool:
        # Once its process ended: one that hangs after writing its result still meets its deadline.
        return bool(job.done() and job.paths.result_pickle.exists())

    def ended(self, waiting: list[base.TrialJob], batch: dict[str, Any]) -> dict[int, str]:
        """Each ended job's exit status, or why it was killed: its deadline, or `stop_check`; every
        PROGRESS_S, a "still running" line for the first trial still running."""
        now, t0 = time.monotonic(), batch["t0"]
        note = now >= batch.setdefault("note", t0 + PROGRESS_S)
        reasons = {}
        for trial in waiting:
            if trial.job.done():
                reasons[trial.slot] = self._exit_reason(trial.job)
                continue
            if note:
                progress_log.info(
                    "trial #%d still running (%s elapsed, timeout %g s)",
                    trial.number, duration(now - t0), self.timeout_s,
                )  # fmt: skip
                note, batch["note"] = False, now + PROGRESS_S
            stop = self.stop_check(trial.slot) if self.stop_check is not None else None
            if stop is not None:
                log.warning("%s", stop)
            elif time.monotonic() > t0 + self.timeout_s:
                limit = f"timed out after {self.timeout_s:g} s (hydra.launcher.timeout_s)"
                stop = f"{limit}: the trial process was killed"
            if stop is not None:
                self._kill(trial.job)
                reasons[trial.slot] = stop
        return reasons

    def _exit_reason(self, job: Any) -> str:
        """How the job's process ended, from the exit codes and pids its controller wrote (else the
        controller's own status: it died itself)."""
        try:
            record = json.loads((job.paths.folder / f"{job.job_id}{EXIT_CODES_SUFFIX}").read_text())
            codes, pids = list(record["codes"]), [int(pid) for pid in record.get("pids", [])]
        except (OSError, ValueError, KeyError, TypeError):
            process = job_process(job)
            codes, pids = [process.poll() if process is not None else None], []
        code = next((c for c in codes if c not in (0, None)), codes[0] if codes else None)
        evidence = self._oom_watch.evidence(pids) if code == -signal.SIGKILL else None
        reason = lifeline.reason_from_log(log_tail(job.paths.stderr)) or describe_exit(
            code, evidence
        )
        crash = fatal_error(job.paths.stderr)
        return f"{reason}: {crash}" if crash else reason

    @staticmethod
    def _kill(job: Any) -> None:
        """SIGKILL the job's process group: shell, controller, trial, DataLoader workers."""
        process = job_process(job)
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("job %s did not end after SIGKILL", job.job_id)


def _controller() -> type:
    """submitit's local job controller, also writing its tasks' exit codes and pids next to the
    job's logs: a trial killed by a signal leaves no result pickle, and submitit's controller keeps
    the status to itself, so the reason could not say "killed by signal SIGSEGV"."""
    from submitit.core.utils import JobPaths

    class ExitCodeController(local_controller_class()):  # type: ignore[misc]
        def wait(self, freq: int = 24) -> Any:
            codes = super().wait(freq)
            folder = JobPaths(self.folder, self.pid, 0).folder
            with contextlib.suppress(OSError):
                record = {"codes": list(codes), "pids": [task.pid for task in self.tasks]}
                (folder / f"{self.pid}{EXIT_CODES_SUFFIX}").write_text(json.dumps(record))
            return codes

    return ExitCodeController


if __name__ == "__main__":  # a job's controller (`_start_controller`)
    _controller()(Path(sys.argv[1])).run()
