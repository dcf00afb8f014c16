"""What a multi-rank trial's ranks leave in its run directory's `ranks/` folder ($GPUOPT_RANKS_DIR).

A rank that fails writes `rank_N.json` (its TrialResult, `env.failed_at`) before it exits, so its
own error is the trial's reason even when its launcher then kills every other process of the job
(Lightning's DDP launcher SIGKILLs the trial once a rank exited non-zero). The rank that failed
first is the cause; the later ones (a peer's closed connection) its consequence.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from gpuopt.core.result import Status, TrialResult

RANKS_FOLDER = "ranks"  # in the trial's run directory
RESULT_FILE = "rank_{rank}.json"  # a rank's TrialResult (its failure's, or its own result)
RANKS_DIR_ENV = "GPUOPT_RANKS_DIR"
TRIAL_PID_ENV = "GPUOPT_TRIAL_PID"
# Beside a user job's JOB file: ("return", rank 0's value) | ("result", the failed job's result),
# written by gpuopt.processes.user_ranks, read by gpuopt.sweeper.launchers.trial_task.
OUTCOME_FILE = "outcome.pkl"


@dataclass(frozen=True)
class RankFailureRecord:
    """The first failing rank's own account: its number, status, reason and when it failed."""

    rank: int
    status: Status
    reason: str
    at: float

    @property
    def text(self) -> str:
        """The trial's reason: `rank N: <its reason>`."""
        return f"rank {self.rank}: {self.reason}"


def ranks_dir_from_env() -> Path | None:
    """The folder this process's trial keeps its ranks' files in (None outside such a trial)."""
    value = os.environ.get(RANKS_DIR_ENV)
    return Path(value) if value else None


def global_rank() -> int:
    """RANK (torch's elastic launcher), else LOCAL_RANK (Lightning's re-launch on one node), else 0."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def write_rank_result(result: TrialResult, rank: int | None = None) -> Path | None:
    """Write this rank's `result` as `rank_N.json` into `$GPUOPT_RANKS_DIR` (nothing outside a
    trial that asked for it), a failed one stamped with when it failed."""
    folder = ranks_dir_from_env()
    if folder is None:
        return None
    rank = global_rank() if rank is None else rank
    data = result.to_dict()
    data["env"] = {**(data.get("env") or {}), "rank": rank}
    if not result.ok:
        data["env"].setdefault("failed_at", time.time())
    path = folder / RESULT_FILE.format(rank=rank)
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, default=str))
        return path
    return None


def first_failure(folder: Path | None) -> RankFailureRecord | None:
    """The rank that failed first among the `rank_N.json` results in `folder` (None: none failed)."""
    if folder is None or not folder.is_dir():
        return None
    failed = []
    for path in folder.glob("rank_*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            data = json.loads(path.read_text())
            status = Status(data["status"])
            if status is Status.OK:
                continue
            env = data.get("env") or {}
            rank = int(env.get("rank", path.stem.split("_")[1]))
            at = float(env.get("failed_at") or 0.0)
            failed.append(RankFailureRecord(rank, status, data.get("reason") or status.value, at))
    return min(failed, key=lambda f: (f.at, f.rank), default=None)


def clear(folder: Path) -> None:
    """An earlier attempt's rank files gone (a trial re-run in the same run directory)."""
    for path in folder.glob("rank_*.json"):
        with contextlib.suppress(OSError):
            path.unlink()
