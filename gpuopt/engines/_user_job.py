"""The user's own multi-rank job, measured as one trial: a torchrun-style script that initialized
its process group itself, a Lightning strategy's ranks, the Hugging Face Trainer under torchrun.

gpuopt starts no rank here; it joins what the user started. Two things make the measurement the
job's rather than one rank's:

- `user_ranks`: every rank's timed window starts at a barrier and stops after the same step, rank
  0's stop rule broadcast at step counts (`gpuopt.engines._distributed.Ranks.align`). A rank whose
  rule stopped one step early would leave its peers waiting in the step's all-reduce until the
  group's timeout;
- `job_result`: every rank's `TrialResult` gathered (`all_gather_object`, host-side) and merged as
  gpuopt's own distributed trials merge theirs (`gpuopt.trial.ranks.merge_ranks`: global
  throughput over the slowest rank's window, the straggler, the worst data wait, the largest
  peak). Every rank returns the same merged result, so a script that prints or saves it on rank 0
  and one that returns it from a sweep's task on every rank agree.

A rank that failed before the gather (its own OOM or crash) leaves its peers in a collective: the
launcher (torchrun, Lightning's, or gpuopt's `hydra.launcher.nproc_per_node`) ends them and reports
the failing rank's own error.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gpuopt.core.rank_files import write_rank_result
from gpuopt.core.result import TrialResult
from gpuopt.core.spec import DistributedConf
from gpuopt.trial.ranks import merge_ranks

if TYPE_CHECKING:
    import torch

    from gpuopt.engines._distributed import Ranks


class RankFailed(RuntimeError):
    """This rank's measurement failed (`result`: its OOM, divergence or error) in a multi-rank job:
    raised rather than returned, so that the rank exits and its launcher ends its peers, which
    would otherwise wait in the step's collective until the group's timeout. In a sweep's trial
    the rank writes `result` into the trial's `ranks/` folder first (gpuopt.core.rank_files): the
    launcher may kill the trial's process next (Lightning's does), and this rank's own error must
    still be the trial's reason."""

    def __init__(self, result: TrialResult) -> None:
        super().__init__(result.reason or result.status.value)
        self.result = result
        write_rank_result(result, rank=_rank())


def _rank() -> int | None:
    """This rank's number in the initialized group (None: the launcher's environment says)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    """Ranks of the initialized default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def user_ranks(device: torch.device) -> Ranks | None:
    """This rank of the user's initialized process group, to align the window with (None in one
    process). Host-side agreement runs over a gloo group (the default group under gloo)."""
    import torch.distributed as dist

    from gpuopt.engines._distributed import Ranks

    if world_size() < 2:
        return None
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    conf = DistributedConf(kind="ddp", nproc_per_node=dist.get_world_size())
    return Ranks(conf, dist.get_rank(), dist.get_world_size(), device, group)


def job_result(result: TrialResult, ranks: Ranks | None, started: float) -> TrialResult:
    """The job's one result from every rank's `result` (this rank's, as is, in one process)."""
    import torch.distributed as dist

    if ranks is None:
        return result
    gathered: list[dict | None] = [None] * ranks.world
    dist.all_gather_object(gathered, result.to_dict(), group=ranks.host_group)
    results = {rank: TrialResult.from_dict(data) for rank, data in enumerate(gathered) if data}
    merged = merge_ranks(results, {}, dist.get_backend(), time.time() - started)
    merged.config = result.config
    return merged
