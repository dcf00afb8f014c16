"""The user-step engine (`gpuopt.measure_step`): the user's own training step over the user's own
batches, measured like a built-in trial. gpuopt builds nothing here; it owns the order of work and
the clocks. What one optimizer step trains on is given (`global_batch=`) or counted from the
optimizer's step post-hook (`optimizer=`), not by wrapping `step`.

Not in the engine registry: a step function is Python, not config. No numerics guard either:
gpuopt cannot re-train the user's step the fp32 way.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gpuopt.core.checks import measure_conf
from gpuopt.core.result import Metrics, TrialResult
from gpuopt.core.spec import EngineConf, LoaderConf, MeasureConf, TrialSpec
from gpuopt.engines._batches import BatchFeed, SampleCount, batch_samples, move_batch
from gpuopt.engines._ceiling import CeilingReplay
from gpuopt.engines._lifecycle import measuring_spec, run_measured
from gpuopt.engines._loss import step_loss
from gpuopt.engines._meter import WindowMeter
from gpuopt.engines._user_job import (
    RankFailed,
    job_result,
    optimizer_lr,
    user_ranks,
    world_size,
)
from gpuopt.engines._window import record_flops
from gpuopt.trial.context import Trial
from gpuopt.trial.failures import NonFiniteLoss
from gpuopt.trial.measure import measure_step_flops
from gpuopt.trial.memory import MemoryBaseline

if TYPE_CHECKING:
    from gpuopt.engines._distributed import Ranks

ENGINE_NAME = "user_step"


@dataclass
class OptimizerSteps:
    """Samples and batches between the optimizer's steps, counted by a step post-hook (fired by
    every `optimizer.step()`, also through a GradScaler or Lightning-style closures)."""

    optimizer: torch.optim.Optimizer
    pending: tuple[int, int] = (0, 0)  # (samples, batches) since the last optimizer step
    steps: list[tuple[int, int]] = field(default_factory=list)  # (samples, batches) per step
    handle: Any = None

    def attach(self) -> None:
        self.handle = self.optimizer.register_step_post_hook(self._stepped)

    def close(self) -> None:  # a trial resource: detached once the trial is released
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def add(self, samples: int) -> None:
        self.pending = (self.pending[0] + samples, self.pending[1] + 1)

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps.append(self.pending)
        self.pending = (0, 0)

    def typical(self) -> tuple[int, int] | None:
        """The most common (samples, batches) of one optimizer step (an epoch's short last batch
        or a step a GradScaler skipped is the exception); None when the optimizer never stepped."""
        counted = [step for step in self.steps if step[1] > 0]
        return statistics.mode(counted) if counted else None


@dataclass
class UserStep:
    step: Callable[[Any], Any]  # one training step on a batch; may return its loss (NaN check)
    batches: Iterable[Any]  # re-iterable (restarted at its end): a DataLoader, a list
    move: Callable[[Any], Any]  # each batch to where the step runs (or as it comes)
    model: torch.nn.Module | None = None  # for MFU: flops are counted on one step when given
    samples: SampleCount = None  # per batch: a count or a function of the batch (None: dim 0)
    nonfinite: NonFiniteLoss = field(default_factory=NonFiniteLoss)
    global_batch: int | None = None  # samples per optimizer step, as the user gave it
    counter: OptimizerSteps | None = None  # counts them from the optimizer's steps
    ranks: Ranks | None = None  # the user's initialized process group (gpuopt.engines._user_job)

    def train(self, batch: Any) -> int:
        """One step on `batch`; its sample count. The loss feeds the NaN check without a host sync."""
        samples = batch_samples(batch, self.samples)
        if self.counter is not None:
            self.counter.add(samples)  # before the step: its optimizer.step() closes the count
        loss = step_loss(self.step(batch))
        if loss is not None and loss.numel() == 1:
            self.nonfinite.update(loss)
        return samples


def run_user_step(user: UserStep, trial: Trial, process_t0: float) -> None:
    """The engine: fill `trial.metrics`, raising on failure (`run_measured` classifies it)."""
    device, m = trial.device, trial.metrics
    memory = MemoryBaseline.take(device)
    if user.counter is not None:
        user.counter.attach()
        trial.resources.append(user.counter)
    feed = BatchFeed(user.batches, user.move, device, user.samples)
    trial.resources.append(feed)
    trial.show("feed", feed)

    first_batch = feed.next()
    micro_batch = batch_samples(first_batch, user.samples)
    if trial.spec.measure.count_flops and user.model is not None:
        flops = measure_step_flops(lambda: user.train(first_batch))  # one (untimed) training step
        record_flops(trial, flops, micro_batch, trial.spec.precision.mode)
    meter = WindowMeter(trial, user.ranks, wait=feed.wait, memory=memory, count_flops=False)
    try:
        meter.measure(feed, lambda: user.train(feed.next()), user.nonfinite.check, process_t0)
    finally:  # a diverged window too
        m.compile_time_s = None  # the user's step: gpuopt cannot tell a compile step apart
    record_training(user, micro_batch, m, trial.warnings)
    if trial.spec.measure.ceiling and user.ranks is not None:  # each step would be a collective
        trial.warnings.append("no compute ceiling in a multi-rank job (its replay is per rank)")
    elif trial.spec.measure.ceiling:
        feed.close()
        ceiling = CeilingReplay.for_trial(trial.spec, device)
        ceiling.run(lambda: user.train(first_batch))
        ceiling.record(m)
        user.nonfinite.check("the compute-ceiling replay")


def record_training(user: UserStep, micro_batch: int, m: Metrics, warnings: list[str]) -> None:
    counted = user.counter.typical() if user.counter is not None else None
    if counted is not None:
        counted = (counted[0] * world_size(), counted[1])  # every rank steps with the others
    m.micro_batch = micro_batch
    m.global_batch = user.global_batch or (counted[0] if counted else None)
    if counted is not None:
        m.accumulation_steps = counted[1]
        if user.global_batch is not None and counted[0] != user.global_batch:
            warnings.append(
                f"global_batch={user.global_batch} given, but {counted[0]} samples were counted "
                "between optimizer steps: the given value is reported"
            )
    elif m.global_batch is not None and m.global_batch % micro_batch == 0:
        m.accumulation_steps = m.global_batch // micro_batch
    if user.counter is not None:
        m.lr = optimizer_lr(user.counter.optimizer)
        if counted is None:
            warnings.append(
                "the optimizer never stepped during the measurement: its global batch is unknown"
            )


def _as_is(batch: Any) -> Any:
    return batch


def _resolve_device(
    device: str | torch.device | None, model: torch.nn.Module | None
) -> torch.device:
    if device is not None:
        return torch.device(device)
    if model is not None:
        parameter = next(model.parameters(), None)
        if parameter is not None:
            return parameter.device
    from gpuopt.trial.devices import resolve_device

    return resolve_device("auto")


def _describe(user: UserStep, device: torch.device, spec: TrialSpec) -> dict[str, Any]:
    step = getattr(user.step, "__qualname__", type(user.step).__name__)
    return {
        "engine": {"name": ENGINE_NAME},
        "step": f"{getattr(user.step, '__module__', '?')}.{step}",
        "model": type(user.model).__name__ if user.model is not None else None,
        "device": {"type": str(device)},
        "loader": {"pin_memory": spec.loader.pin_memory, "non_blocking": spec.loader.non_blocking},
        "precision": {"mode": spec.precision.mode},
        "measure": dataclasses.asdict(spec.measure),
    }


def measure_step(
    step: Callable[[Any], Any],
    batches: Iterable[Any],
    *,
    model: torch.nn.Module | None = None,
    device: str | torch.device | None = None,
    samples_per_batch: int | Callable[[Any], int] | None = None,
    measure: MeasureConf | Mapping[str, Any] | str | None = None,
    non_blocking: bool = False,
    pin_memory: bool = False,
    precision: str = "fp32",
    ceiling: bool = True,
    global_batch: int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> TrialResult:
    """Measure your own training step on your own batches; never raises for a failing step.

    `step(batch)` runs one training step (forward, backward, optimizer step) and may return the
    loss (a tensor, or an output with `.loss`): a NaN/inf loss gives status `diverged`, running out
    of memory `oom`, any other exception `error`, each with its reason. `batches` is re-iterable
    (restarted at its end: a DataLoader, a list). `device`: where to move each batch (recursively:
    tuples, dicts, nested containers; `pin_memory`/`non_blocking` as a DataLoader loop would) and
    where the step runs; without it batches are passed as they come and the device is the model's
    (else gpuopt's auto choice). `model` (optional) is only read: flops of one step (counted by
    torch.utils.flop_counter, outside the window) give MFU against the device's documented peak for
    `precision`. `samples_per_batch`: a count, or a function of the batch (default: the batch
    dimension of its first tensor). `measure`: a conf/measure/ preset name ("quick", "default"), a
    dict of MeasureConf fields, or a MeasureConf. `ceiling`: replay the first batch (on the device,
    no loader) for `ceiling_throughput`; turn it off for a step that cannot see a batch twice.

    What the step trains on, so that a sweep can tell which trials are "the same training":
    `global_batch` (samples per optimizer step, all ranks together), or `optimizer` (the one your
    step calls `.step()` on): the samples between its steps are counted (times the world size of
    an initialized torch.distributed group) and its learning rate recorded. Without either the
    result's global_batch and lr are None, and a sweep calls no trial the same training.

    Under an initialized torch.distributed process group (a torchrun-style script, or a sweep's
    `hydra.launcher.nproc_per_node`), call it on every rank: the ranks' windows start together and
    stop after the same step, and every rank gets the job's result (global throughput over the
    slowest rank's window, the straggler; gpuopt.engines._user_job). A rank whose step fails raises
    `RankFailed` (its `result` says why) so that the launcher ends the job: its peers would wait
    in the step's collective otherwise.
    """
    if global_batch is not None and (isinstance(global_batch, bool) or global_batch < 1):
        raise ValueError(f"global_batch={global_batch!r}: a sample count >= 1, or None")
    conf = measure_conf(dict(measure) if isinstance(measure, Mapping) else measure)
    conf = dataclasses.replace(conf, ceiling=ceiling)
    resolved = _resolve_device(device, model)
    move = functools.partial(
        move_batch, device=resolved, non_blocking=non_blocking, pin_memory=pin_memory
    )
    user = UserStep(
        step=step,
        batches=batches,
        move=move if device is not None else _as_is,
        model=model,
        samples=samples_per_batch,
        global_batch=global_batch,
        counter=OptimizerSteps(optimizer) if optimizer is not None else None,
        ranks=user_ranks(resolved),
    )
    loader = LoaderConf(pin_memory=pin_memory, non_blocking=non_blocking)
    spec = measuring_spec(resolved, conf, EngineConf(name=ENGINE_NAME), precision, loader=loader)
    started = time.time()
    result = run_measured(spec, functools.partial(run_user_step, user), device=resolved)
    result.config = _describe(user, resolved, spec)
    if not result.ok and user.ranks is not None:
        raise RankFailed(result)
    return job_result(result, user.ranks, started)
