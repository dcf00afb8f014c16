"""On SLURM, the ranks of one trial are the tasks of its one job: each task's process is one rank,
its env:// variables taken from SLURM's environment (core/rendezvous.slurm_rank_env).

A rank other than 0 that failed exits non-zero after writing its failure (core/rank_files), so
`srun --kill-on-bad-exit=1` ends the other tasks rather than leaving them in a collective. Where
rank 0 raised because a peer failed first ("Connection closed by peer"), the peer's own error is
the trial's reason. Torch-free (it runs in the trial's process before the task imports anything).
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
    """`run()` (the task) as this task's rank of the job."""
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
    """The first failure another rank wrote within PEER_FAILURE_WAIT_S, if any."""
    deadline = time.monotonic() + PEER_FAILURE_WAIT_S
    while True:
        failure = rank_files.first_failure(folder)
        if failure is not None and failure.rank != 0:
            return failure
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
