"""`python -m gpuopt.processes.user_ranks JOB`: a trial's task run as the ranks of one job
(`hydra.launcher.nproc_per_node=N`), started by gpuopt.sweeper.launchers.trial_task.run_ranks,
which reads back `outcome.pkl` beside `JOB`.

The ranks start as gpuopt's own distributed trials start theirs: torch's elastic launcher (the API
behind `torchrun`), so each rank finds the env:// variables torchrun sets (a script's
`dist.init_process_group` joins, Lightning finds its TorchElasticEnvironment and starts no process
of its own) and, as torchrun does with several ranks, OMP_NUM_THREADS=1 unless set; no restarts (a
failed rank is the trial's answer). Each rank restores what the task expects of a Hydra job
(HydraConfig, the working directory, `sys.path`) and runs the job's Hydra callbacks around the
task, as under `torchrun`. A failing rank's result is written to `ranks/rank_N.json`; the first
failure is the trial's (gpuopt.trial.ranks.merge_ranks).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import cloudpickle

from gpuopt.core import measured_job, rank_files
from gpuopt.core.lifeline import set_parent_death_signal
from gpuopt.core.result import Status, TrialResult
from gpuopt.trial.distributed import (
    RanksNotStarted,
    free_port,
    launch_config,
    merged_result,
    run_ranks,
)

RETURN_FILE = "rank_0.return.pkl"  # rank 0's return value


def launch(job_path: Path) -> tuple[str, Any]:
    """Start the job's ranks and wait for them: ("return", rank 0's value pickled) or ("result",
    the failed job's TrialResult as a dict)."""
    job, folder = cloudpickle.loads(job_path.read_bytes()), job_path.parent
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = f"gpuopt-user-{os.getpid()}"
    config = launch_config(job.nproc_per_node, 1, endpoint, job.timeout_s, folder / "logs", run_id)
    if job.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks
    started = time.time()
    try:
        crashed = run_ranks(config, user_rank, (str(job_path),), folder)
    except RanksNotStarted as exc:
        return "result", TrialResult(Status.ERROR, reason=str(exc)).to_dict()
    measured = measured_job.read(folder.parent) if crashed else None
    if measured is not None:  # the ranks' measuring callback ended them (MeasureJob's budget)
        return "result", measured.to_dict()
    if not crashed and (folder / RETURN_FILE).exists():
        return "return", (folder / RETURN_FILE).read_bytes()
    return "result", merged_result(folder, job.nproc_per_node, crashed, "user", started).to_dict()


def user_rank(job_path: str) -> None:
    """One rank (spawned by the launcher): become the trial's Hydra job again, run the task; rank
    0 keeps its return value. A failure is written (its `RankFailed` did so already) and raised,
    so that the launcher ends the other ranks."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    path = Path(job_path)
    # unpickling a task of the main script extends sys.path (main_task)
    job = cloudpickle.loads(path.read_bytes())
    os.environ[rank_files.RANKS_DIR_ENV] = str(path.parent)
    HydraConfig.instance().cfg = job.hydra_cfg  # Hydra's view of the trial, as its run_job left it
    os.chdir(job.cwd)
    rank = int(os.environ["RANK"])
    hydra_callbacks = OmegaConf.select(job.hydra_cfg, "hydra.callbacks") or {}
    callbacks = [instantiate(params) for params in hydra_callbacks.values()]
    for callback in callbacks:
        _notify(callback.on_job_start, config=job.cfg, task_function=job.task)
    try:
        value = job.task(job.cfg)
    except measured_job.TrialMeasured:
        value = None  # measured: the result is in the run directory (rank 0 wrote it)
    except Exception as exc:
        if type(exc).__name__ != "RankFailed":  # its result is written already
            from gpuopt.trial.failures import classify_failure

            status, reason = classify_failure(exc)
            rank_files.write_rank_result(TrialResult(status, reason=reason), rank)
        raise
    ret = JobReturn(status=JobStatus.COMPLETED, _return_value=value, cfg=job.cfg)
    for callback in reversed(callbacks):  # Hydra's order: the last one first
        _notify(callback.on_job_end, config=job.cfg, job_return=ret)
    if rank == 0:
        (path.parent / RETURN_FILE).write_bytes(cloudpickle.dumps(value))


def _notify(hook: Any, **kwargs: Any) -> None:
    """One callback hook, as Hydra calls it for a job: its exception a warning, not the job's."""
    try:
        hook(**kwargs)
    except Exception as exc:
        warnings.warn(
            f"Callback {hook.__qualname__} raised {type(exc).__name__}: {exc}", stacklevel=1
        )


def main(argv: list[str]) -> int:
    set_parent_death_signal()  # ends with the trial; its ranks end with this process
    job_path = Path(argv[0])
    kind, value = launch(job_path)
    (job_path.parent / rank_files.OUTCOME_FILE).write_bytes(cloudpickle.dumps((kind, value)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
