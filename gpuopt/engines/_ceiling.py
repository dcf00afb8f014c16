"""The most this machine can do for this workload, measured after the timed window
(gpuopt.core.limits does the arithmetic): the compute ceiling (`CeilingReplay`), the input
pipeline's cost per sample (`measure_loader_cost`), the machine's limit and MFU against the
measured matmul peak. torch is imported inside functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuopt.core import limits
from gpuopt.core.result import Metrics
from gpuopt.core.spec import TrialSpec
from gpuopt.engines._batches import dataset_length
from gpuopt.trial.measure import mfu_percent, synchronize

if TYPE_CHECKING:
    import torch

    from gpuopt.engines._distributed import Ranks
    from gpuopt.trial.context import Trial

# Compute-ceiling steps run (unmeasured) before timing it: the model is already warm, this only
# re-warms caches for the replayed batch.
CEILING_WARMUP_STEPS = 1
# The ceiling replay stops after this share of measure.time_budget_s (or measure.ceiling_steps).
CEILING_BUDGET_SHARE = 0.25
# ... but not before this many timed replay steps.
CEILING_MIN_STEPS = 3
# The worker-like loop that prices the input pipeline runs this long (at least one batch).
LOADER_COST_BUDGET_S = 0.2
DISTRIBUTED_CEILING_NOTE = (
    "compute ceiling not measured: a distributed trial (its replay is "
    "time-budgeted per rank, and the ranks must step together)"
)


class CeilingReplay:
    """The compute ceiling: the trial's first batch, already on the device, replayed with no loader
    (warm-up steps, then up to `max_steps` timed ones, ended early once `budget_s` passed after
    CEILING_MIN_STEPS: a slow step must not make the ceiling cost more than the window itself). A loop
    calls `run(step)`; a framework's hooks call `begin()`, then `step_done(samples)` per step."""

    def __init__(
        self,
        device: torch.device,
        max_steps: int,
        budget_s: float,
        warmup_steps: int = CEILING_WARMUP_STEPS,
    ) -> None:
        self.device, self.max_steps, self.budget_s = device, max_steps, budget_s
        self.warmup_steps = warmup_steps
        self.done = self.steps = self.samples = 0
        self.seconds: float | None = None
        # The process's CPU time over the timed replay (every compute thread): on CPU, what the
        # compute costs in core-seconds (gpuopt.core.limits).
        self.cpu_seconds: float | None = None
        self._t0 = self._cpu_t0 = 0.0

    @classmethod
    def for_trial(cls, spec: TrialSpec, device: torch.device) -> CeilingReplay:
        budget = CEILING_BUDGET_SHARE * spec.measure.time_budget_s
        return cls(device, spec.measure.ceiling_steps, budget)

    def begin(self) -> None:
        self.done = self.steps = self.samples = 0
        self.seconds = self.cpu_seconds = None
        if self.warmup_steps == 0:
            self._start_timing()

    def _start_timing(self) -> None:
        synchronize(self.device)
        self._t0, self._cpu_t0 = time.perf_counter(), time.process_time()

    def step_done(self, samples: int) -> bool:
        """Count one replayed step of `samples` samples; True once the replay should stop."""
        self.done += 1
        if self.done <= self.warmup_steps:
            if self.done == self.warmup_steps:
                self._start_timing()
            return False
        self.steps += 1
        self.samples += samples
        out_of_budget = (
            self.steps >= CEILING_MIN_STEPS and time.perf_counter() - self._t0 >= self.budget_s
        )
        if self.steps < self.max_steps and not out_of_budget:
            return False
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._cpu_t0
        return True

    def run(self, step: Callable[[], int]) -> None:
        """Replay from a loop: `step()` trains on the batch once and returns its sample count."""
        self.begin()
        while not self.step_done(step()):
            pass

    def record(self, m: Metrics) -> None:
        """ceiling_throughput and input_efficiency (the window's throughput over the ceiling)."""
        if not self.seconds:
            return
        m.ceiling_throughput = self.samples / self.seconds
        m.input_efficiency = 100.0 * m.throughput / m.ceiling_throughput if m.throughput else None


class _PricedLoop:
    """A one-item map-style dataset whose item is a price: fetched inside one DataLoader worker
    process, it does what a worker does per batch (`dataset[i]` for a batch of indices, then the
    loader's collate_fn) for `budget_s`, timed on the worker's own CPU clock, and returns
    (core-seconds, samples). Module-level and torch-free, so it pickles for spawned workers too."""

    def __init__(
        self, dataset: Any, length: int, collate: Any, batch_size: int, budget_s: float
    ) -> None:
        self.dataset, self.length, self.collate = dataset, length, collate
        self.batch_size, self.budget_s = batch_size, budget_s

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> tuple[float, int]:
        started, cpu_started = time.perf_counter(), time.thread_time()
        samples = 0
        while samples == 0 or time.perf_counter() - started < self.budget_s:
            indices = [(samples + i) % self.length for i in range(self.batch_size)]
            self.collate([self.dataset[i] for i in indices])
            samples += self.batch_size
        return time.thread_time() - cpu_started, samples


def _as_is(item: Any) -> Any:
    return item


def measure_loader_cost(loader: Any, budget_s: float = LOADER_COST_BUDGET_S) -> float | None:
    """Core-seconds per sample of the input pipeline: one DataLoader worker process prices a batch
    loop (`_PricedLoop`) on its thread's CPU clock, so other jobs on the cores do not inflate the
    cost. None without a map-style dataset."""
    from torch.utils.data import DataLoader

    dataset = getattr(loader, "dataset", None)
    length = dataset_length(dataset)
    batch_size = getattr(loader, "batch_size", None)
    collate = getattr(loader, "collate_fn", None)
    if not length or not batch_size or collate is None:
        return None
    priced = _PricedLoop(dataset, length, collate, batch_size, budget_s)
    worker = DataLoader(priced, batch_size=None, num_workers=1, collate_fn=_as_is)  # type: ignore[arg-type]
    core_seconds, samples = next(iter(worker))
    return limits.per_sample_cost(core_seconds, samples)


def record_limits(
    trial: Trial,
    ranks: Ranks | None,
    loader_cost_s: float | None,
    replay: Callable[[], CeilingReplay],
    peak_mode: str | None,
) -> None:
    """After every timed span: the compute ceiling (`replay()`, in one process only: it is
    time-budgeted, and the ranks would disagree), the loader/compute cost per sample,
    limit_throughput (what bounds it), limit_efficiency, and (rank 0 alone) mfu_achievable, model
    FLOP/s against this machine's measured matmul peak (cached per hardware fingerprint)."""
    from gpuopt.core.host import usable_cpus
    from gpuopt.trial.matmul_peak import probed_peak_flops

    m, leader, conf = trial.metrics, ranks is None or ranks.leader, trial.spec.measure
    ceiling = None
    if conf.ceiling and ranks is None:
        with trial.phase("ceiling"):
            ceiling = replay()
    elif conf.ceiling and leader:
        trial.warnings.append(DISTRIBUTED_CEILING_NOTE)
    compute_cost = None
    if ceiling is not None and ceiling.cpu_seconds is not None:
        compute_cost = limits.per_sample_cost(ceiling.cpu_seconds, ceiling.samples)
    m.loader_cost_us = None if loader_cost_s is None else loader_cost_s * 1e6
    m.compute_cost_us = None if compute_cost is None else compute_cost * 1e6
    limit = limits.machine_limit(
        trial.device.type, usable_cpus(), loader_cost_s, compute_cost, m.ceiling_throughput
    )
    if limit is not None:
        limit = limits.at_least_achieved(limit, m.throughput)
        m.limit_throughput, m.limit_bound = limit.throughput, limit.bound
        m.limit_efficiency = limits.limit_efficiency(m.throughput, limit.throughput)
    if conf.peak_probe and leader and peak_mode and m.flops_per_sample and m.throughput:
        with trial.phase("peak_probe"):  # cached on disk (gpuopt.trial.matmul_peak)
            m.peak_flops_measured = probed_peak_flops(trial.device, peak_mode)
        m.mfu_achievable = mfu_percent(m.flops_per_sample, m.throughput, m.peak_flops_measured)
