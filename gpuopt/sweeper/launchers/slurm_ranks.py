"""On SLURM, the ranks of one trial are the tasks of its one job (`hydra.launcher.nproc_per_node`
tasks per node x `hydra.launcher.nodes`): submitit runs the trial in every task, and each task's
process is one rank, with the env:// variables torchrun would set taken from SLURM's environment
(`slurm_rank_env`): RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID,
NODE_RANK = SLURM_NODEID, MASTER_ADDR = the job's first node (the rendezvous), MASTER_PORT one port
per job (from its id: every task computes the same one, no task has to tell the others).

A rank other than 0 whose task failed exits non-zero after writing its failure
(gpuopt.core.rank_files): the job's `srun` runs with `--kill-on-bad-exit=1`, so SLURM ends the
other tasks at once rather than leaving them in a collective. Rank 0's return is the trial's
(the launcher reads task 0's result, then cancels whatever still runs of the job); where rank 0
raised because a peer failed first (its collective broke: "Connection closed by peer"), the
peer's own error is the trial's reason, as gpuopt's own ranks report it.

Torch-free (it runs in the trial's process before the task imports anything).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuopt.core import rank_files
from gpuopt.core.rendezvous import slurm_rank_env
from gpuopt.core.result import Status, TrialResult


def run_as_slurm_rank(run: Callable[[], Any], folder: Path) -> Any:
    """`run()` (the task) as this task's rank of the job; a rank other than 0 that failed exits
    non-zero once its failure is written, so that SLURM ends the job's other tasks."""
    ranks = slurm_rank_env(os.environ)
    os.environ.update(ranks)
    rank = int(ranks.get("RANK", "0"))
    try:
        value = run()
    except Exception as exc:
        if rank == 0:
            peer = _peer_failure(folder)
            if peer is None:
                raise
            return TrialResult(peer.status, reason=peer.text)
        value = TrialResult(Status.ERROR, reason=f"{type(exc).__name__}: {exc}")
    if rank > 0 and isinstance(value, TrialResult) and not value.ok:
        if rank_files.first_failure(folder) is None:
            rank_files.write_rank_result(value, rank)
        raise SystemExit(f"rank {rank}: {value.reason}")
    return value


# A peer writes its failure before its process ends, and its end is what breaks rank 0's
# collective; this long is left for a file system slower than the socket's news.
PEER_FAILURE_WAIT_S = 1.0


def _peer_failure(folder: Path) -> rank_files.RankFailureRecord | None:
    """The first failure another rank of the job wrote, if one did (within PEER_FAILURE_WAIT_S)."""
    deadline = time.monotonic() + PEER_FAILURE_WAIT_S
    while True:
        failure = rank_files.first_failure(folder)
        if failure is not None and failure.rank != 0:
            return failure
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
