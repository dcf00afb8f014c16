"""The native engine (`engine=native`): gpuopt's own training loop over the workload a `TrialSpec`
describes, with gpuopt's own step (`gpuopt.engines._step.Workload`).

Order of work, each a phase of the trial's phase clock: build -> FLOP count (once per process per
`flops_key`) -> compile step -> warm-up -> timed window -> profiled window -> epoch boundary and
loader cost -> compute ceiling -> the machine's limit -> the measured matmul peak -> (once the
trial's memory is released) the numerics guard. In a rank of a distributed trial what runs on one
rank alone (the ceiling's time-budgeted replay, the matmul peak) runs on rank 0 or not at all.

The sweeper's probing processes build their trials here too, through `registry.engine_entry`:
`open_windows` (gpuopt.processes.shared_windows) and `repeated_step` (gpuopt.processes.memory_probe).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpuopt.core.spec import DATA_GPUOPT_KEYS, TrialSpec
from gpuopt.engines._batches import BatchFeed, batch_samples, build_loader, record_batches
from gpuopt.engines._build import TrialPolicies, apply_policies, instantiate_data, instantiate_model
from gpuopt.engines._ceiling import CeilingReplay, record_limits
from gpuopt.engines._distributed import Ranks
from gpuopt.engines._epoch import beside_window
from gpuopt.engines._guard import guard_numerics
from gpuopt.engines._meter import WindowMeter
from gpuopt.engines._step import Batch, Workload, build_workload
from gpuopt.engines._window import record_flops, record_profile
from gpuopt.trial import policies
from gpuopt.trial.context import Trial
from gpuopt.trial.measure import StepFlops, measure_step_flops, synchronize
from gpuopt.trial.memory import MemoryBaseline


def build(
    trial: Trial, trial_policies: TrialPolicies, ranks: Ranks | None = None
) -> tuple[Workload, BatchFeed]:
    """The model on the device, its optimizer and the DataLoader, seeded by `seed` (under
    `ranks`: the model wrapped, the loader seeded per rank)."""
    spec, device = trial.spec, trial.device
    torch.manual_seed(spec.seed)
    dataset = instantiate_data(spec)
    model = instantiate_model(spec)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model._target_={spec.model['_target_']} built a {type(model).__name__}, not an nn.Module"
        )
    non_blocking = spec.loader.non_blocking
    workload = build_workload(spec, model, device, trial_policies.precision, non_blocking, ranks)
    seed = spec.seed + ranks.rank if ranks is not None else None  # a rank's own samples
    loader = build_loader(spec, dataset, device, trial.warnings, seed=seed)
    feed = BatchFeed(loader, workload.to_device, device, accumulation_steps=spec.accumulation_steps)
    trial.resources += [workload, feed]
    trial.show("loader", loader)
    trial.show("model", workload.model)
    trial.show("workload", workload)
    return workload, feed


def count_flops(trial: Trial, workload: Workload, batch: Batch) -> None:
    """flops_per_sample from one forward+backward of the eager module on one micro-batch (outside
    the window), counted once per process per `flops_key`, and the notes its MFU must be read with."""
    key = flops_key(trial.spec, trial.device, batch)
    if key not in _flops_per_sample:
        eager, workload.forward = workload.forward, workload.model
        try:
            flops = measure_step_flops(lambda: workload.forward_backward(batch))
        finally:
            workload.forward = eager
            workload.optimizer.zero_grad(set_to_none=True)
        _flops_per_sample[key] = (flops, batch_samples(batch))
    record_flops(trial, *_flops_per_sample[key], trial.spec.precision.mode)


# One counted step's FLOPs and its samples, counted once per process for each `flops_key`:
# flop_counter counts the operators' shapes, which the knobs a sweep searches do not change (per
# sample; the eager module).
_flops_per_sample: dict[str, tuple[StepFlops, int]] = {}


def flops_key(spec: TrialSpec, device: torch.device, batch: Batch) -> str:
    """What flops_per_sample depends on, hashed."""

    def shapes(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return [str(value.dtype), list(value.shape[1:])]
        if isinstance(value, dict):
            return {k: shapes(v) for k, v in sorted(value.items())}
        if isinstance(value, (list, tuple)):
            return [shapes(v) for v in value]
        return type(value).__name__

    keep = {
        "model": {k: v for k, v in spec.model.items() if k != "channels_last"},
        "loss": spec.loss,
        "data": {k: v for k, v in spec.data.items() if k not in DATA_GPUOPT_KEYS},
        "sample": shapes(batch),
        "distributed": spec.distributed.kind,
        "device": device.type,
    }
    return hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def timed_window(
    trial: Trial,
    workload: Workload,
    feed: BatchFeed,
    first_step: list[Batch],
    cache_policy: policies.CachePolicy,
    memory: MemoryBaseline,
    process_t0: float,
    ranks: Ranks | None = None,
) -> None:
    """The warm-up (compile_time_s included: the first step through torch.compile is `first_step`,
    already fetched, so compile time is the step's own) and the timed window, each a phase."""
    pending = [first_step] if trial.spec.compile.mode != "off" else []

    def train() -> None:
        workload.train_step(pending.pop() if pending else feed.next_step())

    after_step = cache_policy.after_step
    meter = WindowMeter(
        trial, ranks, wait=feed.wait, memory=memory, after_step=after_step, count_flops=False
    )
    meter.measure(feed, train, workload.check_finite, process_t0)


def compute_ceiling(
    trial: Trial, workload: Workload, feed: BatchFeed, first_step: list[Batch]
) -> CeilingReplay:
    """The same step on batches already on the device, no loader: the most this step can do."""
    feed.close()
    samples = sum(batch_samples(batch) for batch in first_step)

    def replay() -> int:
        workload.train_step(first_step)
        return samples

    ceiling = CeilingReplay.for_trial(trial.spec, trial.device)
    ceiling.run(replay)
    ceiling.record(trial.metrics)
    workload.check_finite("the compute-ceiling replay")
    return ceiling


def profiled_window(
    trial: Trial, workload: Workload, feed: BatchFeed, ranks: Ranks | None = None
) -> None:
    """A few steps under torch.profiler, outside the timed window, the step's callables annotated
    as its phases. In a distributed trial every rank profiles the same steps after a barrier
    (they are collectives)."""
    from gpuopt.trial.profiled_window import Annotation, run_profiled_window, steps_within_budget

    phases = [
        Annotation(feed, "next", "next_batch"),
        Annotation(workload, "to_device", "h2d_copy"),
        Annotation(workload, "forward_backward", "forward_backward"),
        Annotation(workload, "forward", "forward"),
        Annotation(workload.optimizer, "step", "optimizer"),
    ]
    conf = trial.spec.profile
    if ranks is None:  # ranks profile the same steps: their own step times could disagree
        conf = steps_within_budget(conf, trial.metrics.step_time_ms)
    summary = run_profiled_window(
        lambda: workload.train_step(feed.next_step()),
        phases,
        trial.device,
        conf,
        rank=ranks.rank if ranks is not None else None,
        align=ranks.barrier if ranks is not None else None,
    )
    record_profile(trial, summary)
    workload.check_finite("the profiled window")


def measure(trial: Trial, process_t0: float) -> None:
    """The engine: fill `trial.metrics`, raising on failure (run_measured classifies it)."""
    phase = trial.phase
    with phase("setup"):
        ranks = Ranks.current(trial.spec, trial.device)
        trial.after_release.append(guard_numerics)  # every rank; rank 0 records
        memory = MemoryBaseline.take(trial.device)
        trial_policies = apply_policies(trial.spec, trial.device)
    with phase("build"):
        workload, feed = build(trial, trial_policies, ranks)
    with phase("first_batch"):  # the loader's workers start and make the first optimizer step
        record_batches(trial)
        first_step = feed.next_step()
    if trial.spec.measure.count_flops:
        with phase("flops"):
            count_flops(trial, workload, first_step[0])
    timed_window(trial, workload, feed, first_step, trial_policies.cache, memory, process_t0, ranks)
    window_fetch_s = feed.wait.fetch_s  # the window's (its marks stopped with the window)
    if trial.spec.profile.enabled:  # before the boundary stops the loader
        with phase("profile"):
            profiled_window(trial, workload, feed, ranks)
    loader_cost = beside_window(trial, feed.loader, window_fetch_s, feed.close)
    replay = functools.partial(compute_ceiling, trial, workload, feed, first_step)
    record_limits(trial, ranks, loader_cost, replay, trial.spec.precision.mode)


LOADER_KEEPS_UP = 1.0  # data_wait (%) under which a configuration's loader keeps up


@dataclass
class WindowedTrial:
    """One configuration built once and measured in short windows of a process it shares with
    others (gpuopt.processes.shared_windows)."""

    trial: Trial
    workload: Workload
    feed: BatchFeed
    cache: policies.CachePolicy  # its after_step hook runs in each window
    # Its whole trial's data_wait (%), when known (the confirmation's arms measured it).
    data_wait: float | None = None
    drained: int = 0  # untimed steps before the last window (its drain)
    read_on_drain: bool = False  # the last window was its drain (`window`'s give_up_below)

    def queued_steps(self, warm: bool = False) -> int:
        """Untimed steps before a window, so it starts at the steady rate: those whose batches the
        idle loader's workers prefetched while another configuration was measured, plus one that
        re-warms the caches, unless `warm` (the last steps this process ran were this one's: a cnn
        screen's batch-512 fp32 candidate spent 5 s on it). Only the re-warming step where its
        trial measured the loader keeping up (data_wait under LOADER_KEEPS_UP): its queue is full
        in the steady state too, and draining it cost a cnn's 2-worker candidate 5 untimed steps a
        window for 3 timed ones."""
        loader = self.trial.spec.loader
        prefetched = loader.num_workers * (loader.prefetch_factor or 2) if loader.num_workers else 0
        rewarm = 0 if warm else 1
        if self.data_wait is not None and self.data_wait < LOADER_KEEPS_UP:
            return rewarm
        return -(-prefetched // self.workload.accumulation_steps) + rewarm

    def window(
        self,
        window_s: float,
        min_steps: int,
        deadline_s: float | None = None,
        warm: bool = False,
        give_up_below: float | None = None,
    ) -> tuple[int, float, int]:
        """One window after the queue's drain (`queued_steps`): optimizer steps until `window_s`
        and `min_steps` are both reached; (steps, seconds, samples). `deadline_s` (the race's
        screen): the drain and the window each end after one step once they took that long (fp16
        convs on a CPU: a few steps, not minutes). `give_up_below` (samples/s): a `warm`
        configuration whose drain reads slower ends there (`read_on_drain`): steps on prefetched
        batches right after its own are the fastest it runs, so its window could only read slower."""
        apply_policies(self.trial.spec, self.trial.device)
        measured = self._timed(self.queued_steps(warm), 0.0, deadline_s)  # the drain
        self.drained, seconds, samples = measured
        self.read_on_drain = bool(
            warm and give_up_below and self.drained and samples / seconds < give_up_below
        )
        if not self.read_on_drain:
            measured = self._timed(min_steps, window_s, deadline_s, self.cache.after_step)
        self.workload.check_finite("an interleaved window")
        return measured

    def _timed(self, *steps_args: Any) -> tuple[int, float, int]:
        """`_steps(*steps_args)` timed to their end on the device: (steps, seconds, samples)."""
        self.feed.reset_counters()
        started = time.perf_counter()
        steps = self._steps(*steps_args)
        synchronize(self.trial.device)
        return steps, time.perf_counter() - started, self.feed.samples

    def _steps(
        self,
        min_steps: int,
        min_s: float,
        deadline_s: float | None,
        after_step: Callable[[int], Any] | None = None,
    ) -> int:
        """Optimizer steps until `min_steps` and `min_s`, or (after one) `deadline_s`; how many."""
        steps, started = 0, time.perf_counter()
        while True:
            elapsed = time.perf_counter() - started
            if steps >= min_steps and elapsed >= min_s:
                return steps
            if steps and deadline_s is not None and elapsed >= deadline_s:
                return steps
            self.workload.train_step(self.feed.next_step())
            if after_step is not None:
                after_step(steps)
            steps += 1

    def close(self) -> None:
        self.feed.close()


def open_windows(spec: TrialSpec, device: torch.device) -> WindowedTrial:
    """`spec` built as this engine builds a trial, then its warm-up steps (outside any window)."""
    trial = Trial(spec, device)
    policies = apply_policies(spec, device)
    workload, feed = build(trial, policies)
    try:
        for _ in range(spec.measure.warmup_steps):
            workload.train_step(feed.next_step())
        workload.check_finite("warm-up")
    except BaseException:
        feed.close()
        raise
    return WindowedTrial(trial, workload, feed, policies.cache)


def repeated_step(spec: TrialSpec, device: torch.device) -> Callable[[], Any]:
    """`spec` built as this engine builds a trial, and a step that trains on the loader's first
    optimizer step again at each call, the workers stopped first (the memory probe: a step's
    peak, no loader beside it)."""
    trial = Trial(spec, device)
    workload, feed = build(trial, apply_policies(spec, device), Ranks.current(spec, device))
    step_on_device = feed.next_step()
    feed.close()
    return lambda: workload.train_step(step_on_device)
