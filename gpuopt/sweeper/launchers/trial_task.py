"""The task a trial process runs: the app's task, presented as a single run of its script, and run
as one process or as the ranks of one job.

**A single run of the script.** In a trial the program is submitit's job and `sys.argv` the
sweep's, so a training that re-runs "the program" for its other ranks starts the wrong one:
Lightning's DDP launcher (FSDP's, ModelParallelStrategy's on `devices=N`) re-runs
`python <sys.argv[0]> <sys.argv[1:]>` (or `-m <__main__.__spec__.name>`) plus `hydra.run.dir=...
hydra.job.name=train_ddp_process_N hydra.output_subdir=null` (Lightning 2.6,
`_hydra_subprocess_cmd`). While the task runs, `single_run` makes the trial look like
`python train.py <the trial's overrides>` (argv through relaunched_rank.py, a spec-free
`__main__` so that spawn re-imports the script by path, `hydra.run.dir` the trial's run dir).

**The ranks of one job** (`hydra.launcher.nproc_per_node=N`): N ranks started by torch's elastic
launcher in a process of the trial's (gpuopt.processes.user_ranks), rank 0's return the trial's;
on SLURM each of the job's tasks is one rank (`run_as_slurm_rank`). A rank's failure is the
trial's result: the one that failed first (gpuopt.core.rank_files), `rank N: <its own error>`.

Hydra imports the launchers on every run (plugin discovery): no torch here, no submitit at import.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt.core import measured_job, rank_files
from gpuopt.core.rendezvous import slurm_rank_env
from gpuopt.core.result import Status, TrialResult
from gpuopt.sweeper.launchers import main_task

# The Hydra options that say which config a script composes (kept for a re-launched rank).
CONFIG_OPTIONS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
# Hydra overrides of the sweep's command line that mean nothing to a single run.
NOT_FOR_A_RUN = (
    "hydra.mode", "hydra.sweeper", "hydra/sweeper", "hydra.launcher", "hydra/launcher", "hydra.sweep."
)  # fmt: skip
RELAUNCHED_BY = ("hydra.run.dir", "hydra.job.name", "hydra.output_subdir")
RELAUNCH_ENTRY = str(Path(__file__).with_name("relaunched_rank.py"))
RANKS_PROCESS = "gpuopt.processes.user_ranks"
JOB_FILE = "job.pkl"  # the task and its config, for the ranks (cloudpickle)


def entry_args() -> tuple[str, ...]:
    """How a re-launched rank starts the sweep's program: its script (or module), then the config
    options of its command line."""
    module, script = main_task.origin(sys.modules.get("__main__"))
    target = (
        ("--gpuopt-script", script) if script else ("--gpuopt-module", module) if module else ()
    )
    return (*target, "--", *config_arguments(sys.argv[1:]))


def config_arguments(argv: list[str]) -> tuple[str, ...]:
    """The config options of a Hydra command line (`-cp DIR`, `--config-name=x`, ...)."""
    kept: list[str] = []
    for k, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name in CONFIG_OPTIONS:
            kept.append(arg)
            if "=" not in arg and k + 1 < len(argv):
                kept.append(argv[k + 1])
    return tuple(kept)


@dataclass(frozen=True)
class RankPlan:
    """A trial's ranks: `nproc_per_node` started in the trial's process, or (`slurm`) each of the
    job's tasks one rank."""

    nproc_per_node: int = 1
    timeout_s: float = 60.0  # the rendezvous's timeout
    slurm: bool = False


@dataclass(frozen=True)
class TrialTask:
    """The app's task (a `main_task.MainTask` or the function itself) in a trial process."""

    task: Any
    entry: tuple[str, ...]  # `entry_args`
    ranks: RankPlan = RankPlan()

    def __call__(self, cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        folder = Path(str(HydraConfig.get().runtime.output_dir)) / rank_files.RANKS_FOLDER
        if not self.ranks.slurm or os.environ.get("SLURM_PROCID", "0") == "0":
            rank_files.clear(folder)
            (folder.parent / measured_job.MEASURED_FILE).unlink(missing_ok=True)  # a re-run's
        with single_run(self.entry, folder):
            if self.ranks.slurm:
                return run_as_slurm_rank(lambda: own_rank(self.task, cfg, folder), folder)
            if self.ranks.nproc_per_node > 1:
                return run_ranks(self.task, cfg, folder, self.ranks)
            return own_rank(self.task, cfg, folder)


def own_rank(task: Any, cfg: Any, folder: Path) -> Any:
    """The task in this process. A `RankFailed` it raises is the trial's result as the rank that
    failed first wrote it; a measuring callback's result in the run dir (`folder`'s parent) is the
    trial's, whatever the task returned (kept beside it) or whether it ended the job."""
    value = None
    try:
        value = task(cfg)
    except measured_job.TrialMeasured:
        pass
    except Exception as exc:
        own = getattr(exc, "result", None)
        if type(exc).__name__ != "RankFailed" or not isinstance(own, TrialResult):
            raise
        first = rank_files.first_failure(folder)
        if first is not None:
            own.status, own.reason = first.status, first.text
        return own
    measured_job.task_ended()
    measured = measured_job.read(folder.parent)
    if measured is None or measured_job.is_gpuopts_result(value):
        return value  # the task returned gpuopt's result itself (a TrialResult, named metrics)
    return measured_job.with_app_return(measured, value)


@contextlib.contextmanager
def single_run(entry: tuple[str, ...], folder: Path) -> Iterator[None]:
    """While the task runs: `sys.argv`, `__main__`, `hydra.run.dir` and the environment as a
    re-launched rank of a single run of the script needs them."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict, read_write

    hydra = HydraConfig.get()
    with read_write(hydra), open_dict(hydra):
        hydra.run.dir = str(hydra.runtime.output_dir)
    argv, main = sys.argv, sys.modules.get("__main__")
    environ = {k: os.environ.get(k) for k in (rank_files.RANKS_DIR_ENV, rank_files.TRIAL_PID_ENV)}
    sys.argv = [RELAUNCH_ENTRY, *entry, *run_overrides(hydra)]
    sys.modules["__main__"] = _spec_free_main(main)
    os.environ[rank_files.RANKS_DIR_ENV] = str(folder)
    os.environ[rank_files.TRIAL_PID_ENV] = str(os.getpid())
    try:
        yield
    finally:
        sys.argv = argv
        current = sys.modules.get("__main__")
        if main is not None and getattr(current, "__name__", "") != main_task.MAIN_ALIAS:
            sys.modules["__main__"] = main  # unless the script took its place (main_task)
        for key, value in environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_overrides(hydra: Any) -> list[str]:
    """The trial's task overrides and the Hydra overrides that still mean something in a run."""
    task = [str(o) for o in hydra.overrides.task]
    own = [str(o) for o in hydra.overrides.hydra]
    kept = [o for o in own if not o.lstrip("+~").startswith((*NOT_FOR_A_RUN, *RELAUNCHED_BY))]
    return [*task, *kept]


def _spec_free_main(main: types.ModuleType | None) -> types.ModuleType:
    """A `__main__` without a spec, as under `python train.py` (spawn and Lightning then go by
    path): the script's module, else a stand-in whose file is the rank entry."""
    if main is not None and getattr(main, "__name__", "") == main_task.MAIN_ALIAS:
        main.__spec__ = None
        return main
    stand_in = types.ModuleType("__main__")
    stand_in.__file__ = RELAUNCH_ENTRY
    stand_in.__spec__ = None
    return stand_in


# -- the ranks of one job, started in this trial (hydra.launcher.nproc_per_node) --------------------
@dataclass(frozen=True)
class RankJob:
    """What each rank needs to run the trial's task, pickled into the trial's `ranks/` folder."""

    task: Any
    cfg: Any  # the task's config (without Hydra's node)
    hydra_cfg: Any  # Hydra's config of the trial (HydraConfig in each rank)
    cwd: str
    nproc_per_node: int
    timeout_s: float


def run_ranks(task: Any, cfg: Any, folder: Path, plan: RankPlan) -> Any:
    """The task as `plan.nproc_per_node` ranks; rank 0's return, or the failed job's result."""
    import cloudpickle
    from hydra.core.hydra_config import HydraConfig

    from gpuopt.sweeper.launchers.results import describe_exit, log_tail

    folder.mkdir(parents=True, exist_ok=True)
    job = RankJob(
        task, cfg, HydraConfig.instance().cfg, os.getcwd(), plan.nproc_per_node, plan.timeout_s
    )
    (folder / JOB_FILE).write_bytes(cloudpickle.dumps(job))
    (folder / rank_files.OUTCOME_FILE).unlink(missing_ok=True)
    log = folder / "launcher.log"
    measured_job.mark_ranks_started()
    with open(log, "wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", RANKS_PROCESS, str(folder / JOB_FILE)],
            stdout=out, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip
    try:
        kind, value = cloudpickle.loads((folder / rank_files.OUTCOME_FILE).read_bytes())
    except (OSError, ValueError, EOFError) as exc:
        reason = f"the ranks' launcher ended without an outcome ({describe_exit(done.returncode)})"
        tail = log_tail(log)
        return TrialResult(Status.ERROR, reason=f"{reason}: {tail.strip() or exc}")
    if kind == "result":
        return TrialResult.from_dict(value)
    return cloudpickle.loads(value)


# -- on SLURM, each task of the trial's job one rank ------------------------------------------------
# A peer writes its failure before its process ends, and its end is what breaks rank 0's
# collective; this long is left for a file system slower than the socket's news.
PEER_FAILURE_WAIT_S = 1.0


def run_as_slurm_rank(run: Callable[[], Any], folder: Path) -> Any:
    """`run()` (the task) as this SLURM task's rank (env:// variables from SLURM's environment).
    A rank other than 0 that failed writes its failure and exits non-zero, so that
    `srun --kill-on-bad-exit=1` ends the other tasks rather than leaving them in a collective;
    where rank 0 raised because a peer failed first ("Connection closed by peer"), the peer's own
    error is the trial's reason."""
    ranks = slurm_rank_env(os.environ)
    os.environ.update(ranks)
    rank = int(ranks.get("RANK", "0"))
    try:
        value = run()
    except Exception as exc:
        if rank == 0:
            deadline = time.monotonic() + PEER_FAILURE_WAIT_S
            while (peer := rank_files.first_failure(folder)) is None or peer.rank == 0:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
            return TrialResult(peer.status, reason=peer.text)
        value = TrialResult(Status.ERROR, reason=f"{type(exc).__name__}: {exc}")
    if rank > 0 and isinstance(value, TrialResult) and not value.ok:
        if rank_files.first_failure(folder) is None:
            rank_files.write_rank_result(value, rank)
        raise SystemExit(f"rank {rank}: {value.reason}")
    return value
