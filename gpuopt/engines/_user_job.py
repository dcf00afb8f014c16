"""The user's own multi-rank job, measured as one trial: a torchrun-style script that initialized
its process group itself, a Lightning strategy's ranks, the Hugging Face Trainer under torchrun.

gpuopt starts no rank here; it joins what the user started:

- `user_ranks`: every rank's window starts at a barrier and stops after the same step
  (`Ranks.align`): a rank that stopped one step early would leave its peers waiting in the
  step's all-reduce until the group's timeout;
- `job_result`: every rank's `TrialResult` gathered and merged as gpuopt's own distributed trials
  merge theirs (`gpuopt.trial.ranks.merge_ranks`). Every rank returns the same merged result, so
  a script that saves it on rank 0 and a sweep's task that returns it on every rank agree.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuopt.core.rank_files import write_rank_result
from gpuopt.core.result import Status, TrialResult
from gpuopt.core.spec import DistributedConf, EngineConf, MeasureConf
from gpuopt.engines._lifecycle import measuring_spec, process_start_time, release
from gpuopt.trial.context import Trial
from gpuopt.trial.failures import classify_failure
from gpuopt.trial.ranks import merge_ranks

if TYPE_CHECKING:
    import torch

    from gpuopt.engines._distributed import Ranks
    from gpuopt.engines._meter import WindowMeter


class RankFailed(RuntimeError):
    """This rank's measurement failed (`result`) in a multi-rank job: raised rather than returned,
    so that the rank exits and its launcher ends its peers, which would otherwise wait in the
    step's collective until the group's timeout. In a sweep's trial the rank writes `result` into
    the trial's `ranks/` folder first: the launcher may kill the trial's process next (Lightning's
    does), and this rank's own error must still be the trial's reason."""

    def __init__(self, result: TrialResult) -> None:
        super().__init__(result.reason or result.status.value)
        self.result = result
        write_rank_result(result, rank=_rank())


def _rank() -> int | None:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    """Ranks of the initialized default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def optimizer_lr(optimizer: Any) -> float | None:
    """The first param group's learning rate; its schedule's starting value (`initial_lr`, set by
    torch's LR schedulers) where one is attached: the same at any point of the schedule."""
    import torch

    groups = optimizer.param_groups if optimizer is not None else []
    lr = groups[0].get("initial_lr", groups[0].get("lr")) if groups else None
    return float(lr) if isinstance(lr, int | float | torch.Tensor) else None


def loader_settings(loader: Any, private: bool = False) -> dict[str, Any]:
    """What a DataLoader was made with (`private`: read from its iterator's private copies): what
    gpuopt.core.search_space traces to config keys."""
    prefix = "_" if private else ""
    sampler = getattr(loader, "_index_sampler", None) if private else loader
    workers = int(getattr(loader, prefix + "num_workers", 0))
    return {
        "batch_size": getattr(sampler, "batch_size", None),
        "num_workers": workers,
        "pin_memory": bool(getattr(loader, prefix + "pin_memory", False)),
        "prefetch_factor": getattr(loader, prefix + "prefetch_factor", None) if workers else None,
        "persistent_workers": bool(getattr(loader, prefix + "persistent_workers", False)),
    }


def user_ranks(device: torch.device) -> Ranks | None:
    """This rank of the user's initialized process group (None in one process)."""
    from gpuopt.engines._distributed import Ranks

    if world_size() < 2:
        return None
    return Ranks.joined(DistributedConf(kind="ddp", nproc_per_node=world_size()), device)


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


class UserLoop:
    """What measuring a loop gpuopt does not own shares (the HF and Lightning callbacks, MeasureJob):
    its one trial and window meter, and its result, a failure as the status."""

    engine_name = ""  # the result's `config`: its engine.name
    measure: MeasureConf
    trial: Trial | None = None
    meter: WindowMeter | None = None
    ranks: Ranks | None = None
    result: TrialResult | None = None
    process_t0 = started = 0.0

    def start_trial(
        self,
        device: torch.device,
        precision_mode: str = "fp32",
        compile_mode: str = "off",
        engine: EngineConf | None = None,
        measure: MeasureConf | None = None,
    ) -> Trial:
        """The loop's trial (`measuring_spec`: `measure`, default its own), its engine named
        `engine_name` unless given."""
        engine = engine or EngineConf(name=self.engine_name)
        spec = measuring_spec(device, measure or self.measure, engine, precision_mode, compile_mode)
        self.trial = Trial(spec, device)
        self.ranks = user_ranks(device)
        self.process_t0 = process_start_time() or time.time()
        self.started = time.time()
        return self.trial

    def config(self) -> dict[str, Any]:
        """The result's `config`: the engine, the measure settings and what `described` adds."""
        measure = dataclasses.asdict(self.measure)
        return {"engine": {"name": self.engine_name}, "measure": measure, **self.described()}

    def described(self) -> dict[str, Any]:
        return {}

    def record_batch(self, micro: int | None, accumulate: int, world: int, lr: Any) -> None:
        """What one optimizer step of a Trainer trained on: `micro` x `accumulate` x `world`."""
        assert self.trial is not None
        m = self.trial.metrics
        m.micro_batch, m.accumulation_steps, m.lr = micro, accumulate, lr
        if micro is not None:
            m.global_batch = micro * accumulate * world

    def run(self, loop: Callable[[], Any], world: int | None = None) -> TrialResult:
        """`loop()` measured (a failure is the status); a failing rank of a multi-rank job
        (`world` ranks, default the process group's) raises `RankFailed` instead."""
        try:
            loop()
        except Exception as exc:
            if self.result is None or self.result.ok:
                self.result = self.failed(exc)
        if self.result is None:  # the loop never ended the window: trained nothing
            self.result = self.failed(RuntimeError("the Trainer did not train"))
        if not self.result.ok and (world_size() if world is None else world) > 1:
            raise RankFailed(self.result)
        return self.result

    def measured(self, record_training: Callable[[], None]) -> TrialResult:
        """The window's result, `record_training` adding what one optimizer step trained on."""
        assert self.meter is not None
        try:
            self.meter.record(self.process_t0)
            record_training()
        except Exception as exc:
            return self.failed(exc)
        return self.finished(Status.OK, None)

    def failed(self, exc: Exception) -> TrialResult:
        status, reason = classify_failure(exc)
        if self.meter is not None:
            self.meter.close()
        if status is Status.OOM and self.trial is not None:
            release(self.trial, status)
        return self.finished(status, reason)

    def finished(self, status: Status, reason: str | None) -> TrialResult:
        from gpuopt.trial.devices import fingerprint

        trial, config = self.trial, self.config()
        if trial is None:
            return TrialResult(status, reason=reason, config=config)
        return TrialResult(
            status, trial.metrics, reason, config, fingerprint(trial.device), trial.warnings
        )
