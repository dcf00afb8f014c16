"""hydra/launcher=slurm: hydra-submitit-launcher's SLURM mode, one result per trial.

The stock SlurmLauncher calls `job.results()` on each job of its array: a job SLURM ends without a
result (time limit, scancel, OOM, a node failure) raises, which ends the batch, or, without
accounting storage (no slurmdbd: submitit reads states from `sacct` only and takes "UNKNOWN" for
running), is waited for forever. This one reads the states from `squeue --states=all` (slurmctld
keeps a finished job MinJobAge seconds, 300 by default), then `sacct`, then slurmstepd's line in
the job's stderr, and records such a job as a failed trial naming SLURM's verdict and the knob.

In the trial job, submitit's USR2 (`signal_delay_s` before the limit) no longer checkpoints and
requeues: a half-measured trial cannot be resumed, and with a limit shorter than `signal_delay_s`
the signal arrives at once. A distributed trial of gpuopt's app is one task per node holding a GPU
per rank (`trial_resources`); a user's task over several ranks is one task per rank
(trial_task.run_as_slurm_rank), task 0's result the trial's, the rest cancelled once it is in.

Hydra imports this module on every run (plugin discovery): no submitit, optuna or torch at import.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf

from gpuopt.sweeper.launchers import submitit_base as base
from gpuopt.sweeper.launchers.results import describe_exit, log_tail
from gpuopt.sweeper.launchers.trial_task import RankPlan

log = logging.getLogger(__name__)

# squeue's long state names for a job that will not run any more (`man squeue`, JOB STATE CODES).
ENDED_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT",
})  # fmt: skip
# srun's option that ends every task of a job step once one exits non-zero: a failed rank.
KILL_ON_BAD_EXIT = "--kill-on-bad-exit=1"
# After SLURM says COMPLETED or FAILED, the job's result pickle may still be on its way through a
# shared file system: wait this long for it before calling the job resultless.
RESULT_GRACE_S = 15.0
# A job of several ranks whose rank 0 returned: how long its other ranks may take to end.
LEFTOVER_GRACE_S = 10.0
# slurmstepd's line in the job's stderr when SLURM ends it: "*** JOB 7 ON node CANCELLED AT
# 2026-12-01T08:39:03 DUE TO TIME LIMIT ***" (or "... CANCELLED AT ... ***" for scancel).
_STEPD_LINE = re.compile(
    r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))? \*\*\*"
)


@dataclass
class GpuoptSlurmConf(SlurmQueueConf):
    _target_: str = "gpuopt.sweeper.launchers.slurm.GpuoptSlurmLauncher"
    # Seconds between two `squeue` calls while the batch's jobs run (one call for the batch).
    poll_s: float = 5.0
    # Each trial's task as this many ranks per node (x nodes): one SLURM task per rank, its
    # env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) from SLURM's environment.
    nproc_per_node: int = 1


base.register(GpuoptSlurmConf, "gpuopt_slurm", "slurm")  # the same launcher, two names


@dataclass(frozen=True)
class SlurmJobState:
    """What SLURM says about one job (or job-array task): squeue's %T and %r."""

    job_id: str
    state: str
    reason: str = ""

    @property
    def ended(self) -> bool:
        return self.state.split()[0] in ENDED_STATES  # "CANCELLED by 0" in sacct


def parse_squeue(text: str) -> dict[str, SlurmJobState]:
    """`squeue -h -r -o %i|%T|%r` lines -> job id ("123" or "123_4") -> state."""
    states = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0]:
            states[parts[0]] = SlurmJobState(parts[0], parts[1], parts[2] if len(parts) > 2 else "")
    return states


def _run(*cmd: str, failed: str = "") -> str | None:
    """A SLURM command's stdout; None when it failed (logging `failed` % the error, if given)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        if failed:
            log.warning(failed, exc)
        return None


def query_squeue(job_ids: Sequence[str]) -> dict[str, SlurmJobState] | None:
    """The states slurmctld still holds for these jobs (None: squeue failed). A job it no longer
    knows (purged MinJobAge seconds after it ended) is absent."""
    out = _run(
        "squeue", "--states=all", "-h", "-r", "-o", "%i|%T|%r", "-j", ",".join(job_ids),
        failed="squeue failed (%s); retrying",
    )  # fmt: skip
    return None if out is None else parse_squeue(out)


def query_sacct(job_id: str) -> SlurmJobState | None:
    """The job's final state from accounting storage; None where there is none (no slurmdbd)."""
    out = _run("sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", job_id) or ""
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        if jid == job_id and state:
            return SlurmJobState(job_id, state)
    return None


def query_exit_code(job_id: str) -> int | None:
    """`scontrol show job`'s ExitCode=code:signal as describe_exit's number (-signal if killed)."""
    out = _run("scontrol", "show", "job", "-o", job_id) or ""
    match = re.search(r"\bExitCode=(\d+):(\d+)", out)
    if match is None:
        return None
    code, sig = int(match.group(1)), int(match.group(2))
    return -sig if sig else code


def state_from_log(job_id: str, stderr_text: str) -> SlurmJobState | None:
    """slurmstepd's "CANCELLED ... DUE TO TIME LIMIT" line in the job's stderr, as a state."""
    match = _STEPD_LINE.search(stderr_text)
    if match is None:
        return None
    cause = (match.group(1) or "").strip()
    state = {"TIME LIMIT": "TIMEOUT", "PREEMPTION": "PREEMPTED", "NODE FAILURE": "NODE_FAIL"}
    return SlurmJobState(job_id, state.get(cause, "CANCELLED"), cause)


# The trial's reason for a job SLURM ended without a result, naming the knob to turn.
END_REASONS = {
    "TIMEOUT": "cancelled by SLURM: TIME LIMIT (hydra.launcher.timeout_min={timeout_min}), {job}",
    "OUT_OF_MEMORY": "killed by SLURM: OUT OF MEMORY (hydra.launcher.mem_gb={mem_gb}), {job}",
    "CANCELLED": "cancelled by SLURM (scancel or an administrator), {job}",
    "PREEMPTED": "preempted by SLURM, {job}",
    "DEADLINE": "cancelled by SLURM: DEADLINE, {job}",
    "NODE_FAIL": "SLURM: NODE FAIL ({node}), {job}",
    "BOOT_FAIL": "SLURM: BOOT FAIL ({node}), {job}",
}


def end_reason(state: SlurmJobState, params: dict[str, Any], exit_code: int | None = None) -> str:
    """END_REASONS' line for the state, else its name and the exit status."""
    name = state.state.split()[0]
    if name in END_REASONS:
        return END_REASONS[name].format(
            job=f"job {state.job_id}",
            timeout_min=params.get("timeout_min"),
            mem_gb=params.get("mem_gb"),
            node=state.reason or "the node failed",
        )
    detail = f" ({state.reason})" if state.reason not in ("", "None") else ""
    return f"SLURM job {state.job_id} ended {name}{detail}: {describe_exit(exit_code)}"


class GpuoptSlurmLauncher(base.TrialJobLauncher, SlurmLauncher):
    """submitit's SLURM mode, where a job that ends without a result is a failed trial."""

    def __init__(self, poll_s: float = 5.0, nproc_per_node: int = 1, **params: Any) -> None:
        super().__init__(**params)
        self.poll_s = base.positive("poll_s", poll_s)
        self.tick_s = min(1.0, self.poll_s)
        self.ranks = RankPlan(
            base.positive("nproc_per_node", nproc_per_node, integer=True), slurm=True
        )
        if self.ranks.nproc_per_node > 1:  # one task per rank
            self.params["tasks_per_node"] = self.ranks.nproc_per_node
        nodes = int(self.params.get("nodes") or 1)
        if nodes * int(self.params.get("tasks_per_node") or 1) > 1:  # one rank per task
            self.params["srun_args"] = [*(self.params.get("srun_args") or []), KILL_ON_BAD_EXIT]

    def in_trial(self) -> None:
        # submitit's USR2 handler (checkpoint + requeue, or raise) is replaced by a log line.
        signal.signal(signal.SIGUSR2, _warn_time_limit)

    def _executor(self, extra: dict[str, Any] | None = None) -> Any:
        """submitit's SlurmExecutor from the launcher's params and `extra` (`trial_resources`)."""
        import submitit

        params = {**self.params, **(extra or {})}
        init_keys = {"max_num_timeout", "python"}
        executor = submitit.AutoExecutor(
            cluster="slurm",
            folder=params.pop("submitit_folder"),
            **{f"slurm_{k}": params.pop(k) for k in init_keys if k in params},
        )
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in base else f"slurm_{k}": v for k, v in params.items()}
        )
        return executor

    def submit(self, trials: list[base.TrialJob], started: list[Any]) -> None:
        """One job array per group of trials with the same needs (`trial_resources`)."""
        groups: dict[tuple[tuple[str, Any], ...], list[base.TrialJob]] = {}
        for trial in trials:
            need = trial_resources(self.trial_config(trial), self.params)
            groups.setdefault(tuple(sorted(need.items())), []).append(trial)
        for extra, group in groups.items():
            args = [trial.args() for trial in group]
            array = self._executor(dict(extra)).map_array(self, *zip(*args, strict=True))
            started += array
            for trial, job in zip(group, array, strict=True):
                trial.job = job
        log.info("submitted SLURM job(s) %s", " ".join(trial.job.job_id for trial in trials))

    def stop(self, started: list[Any]) -> None:
        pending = [job for job in started if not job.paths.result_pickle.exists()]
        _scancel([job.job_id for job in pending])

    def collect(self, trials: list[base.TrialJob]) -> list[JobReturn]:
        """A job of several tasks (ranks) is over once task 0's result is in; a rank still running
        LEFTOVER_GRACE_S later (in a collective with a rank that failed, without --kill-on-bad-exit's
        help) is cancelled: none outlives its trial."""
        returns = super().collect(trials)
        running = [t.job.job_id for t in trials if getattr(t.job, "num_tasks", 1) > 1]
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while running and time.monotonic() < deadline:
            states = query_squeue(running) or {}
            running = [j for j in running if j in states and not states[j].ended]
            if running:
                time.sleep(0.5)
        if running:
            log.warning("trial job(s) %s: rank 0's result is in, other ranks still ran", running)
            _scancel(running)
        return returns

    def ended(self, waiting: list[base.TrialJob], batch: dict[str, Any]) -> dict[int, str]:
        """SLURM's verdict on each job it ended, from one `squeue` every poll_s."""
        if not waiting or time.monotonic() - batch.get("queried", -math.inf) < self.poll_s:
            return {}
        states = query_squeue([trial.job.job_id for trial in waiting])
        batch["queried"] = time.monotonic()
        if states is None:
            return {}
        reasons = {}
        for trial in waiting:
            job = trial.job
            state = states.get(job.job_id) or self._final_state(job)
            exited = state.state in ("COMPLETED", "FAILED")  # its pickle may be on its way
            if not state.ended:
                continue
            trial.seen_end = trial.seen_end or time.monotonic()
            if time.monotonic() - trial.seen_end < (RESULT_GRACE_S if exited else 0.0):
                continue
            code = query_exit_code(job.job_id) if exited else None
            reasons[trial.slot] = end_reason(state, self.params, code)
            log.warning("trial job %s: %s", job.job_id, reasons[trial.slot])
        return reasons

    @staticmethod
    def _final_state(job: Any) -> SlurmJobState:
        """The state of a job slurmctld no longer knows: accounting, else its stderr."""
        return (
            query_sacct(job.job_id)
            or state_from_log(job.job_id, log_tail(job.paths.stderr, chars=20000))
            or SlurmJobState(job.job_id, "FAILED", "purged from slurmctld, no accounting")
        )


def trial_resources(cfg: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The sbatch parameters a trial of gpuopt's app needs beyond the launcher's: a distributed
    trial is one task per node (each node's trial the agent of its ranks, as torchrun is) holding
    one GPU per rank where the launcher asks for GPUs by count (with `gres` the user sizes it),
    and at least one CPU per rank."""
    kind = OmegaConf.select(cfg, "distributed.kind", default="none") if cfg is not None else None
    if kind in (None, "none"):
        return {}
    ranks = int(OmegaConf.select(cfg, "distributed.nproc_per_node", default=1) or 1)
    nodes = int(OmegaConf.select(cfg, "distributed.nnodes", default=1) or 1)
    extra: dict[str, Any] = {"tasks_per_node": 1}
    if nodes > 1:
        extra["nodes"] = nodes
        extra["srun_args"] = (*(params.get("srun_args") or []), KILL_ON_BAD_EXIT)
    for key in ("gpus_per_task", "gpus_per_node"):  # one task per trial: the same count
        if params.get(key) is not None:
            extra[key] = ranks
    if params.get("cpus_per_task") is not None and int(params["cpus_per_task"]) < ranks:
        extra["cpus_per_task"] = ranks
    return extra


def _warn_time_limit(signum: int, frame: Any) -> None:
    """In the trial job: note submitit's USR2 in the job's stderr (os.write: signal-safe)."""
    os.write(
        2,
        f"gpuopt: SLURM sent {signal.Signals(signum).name}: its time limit (or a preemption) is "
        "near; the trial goes on until it ends or SLURM ends it\n".encode(),
    )


def _scancel(job_ids: list[str]) -> None:
    if not job_ids:
        return
    log.warning("cancelling SLURM job(s) %s", " ".join(job_ids))
    _run("scancel", *job_ids, failed="scancel failed: %s")
