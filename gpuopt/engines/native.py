"""The native engine (`engine=native`): gpuopt's own training loop over the workload a `TrialSpec`
describes (the workload contract: `gpuopt.engines._common`).

The step is the standard one: forward (under autocast for fp16/bf16), loss, backward (through a
GradScaler for fp16), optimizer step, zero_grad(set_to_none=True).

Order of work, each part timed apart: build -> FLOP count (one step, outside the window) -> first
step through torch.compile (compile_time_s) -> warm-up (warmup_time_s) -> timed window (monitors on;
the loader's one epoch lasts the whole trial) -> an epoch boundary and the input pipeline's cost per
sample, measured apart -> compute ceiling (the first batch replayed on the device, no loader) ->
the machine's limit -> the measured matmul peak (cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuopt import policies
from gpuopt.engines._common import (
    CeilingReplay,
    EpochBoundary,
    InputWait,
    MemoryBaseline,
    NonFiniteLoss,
    Trial,
    TrialPolicies,
    WindowMonitors,
    apply_policies,
    build_loader,
    build_optimizer,
    compute_loss,
    flop_notes,
    instantiate_data,
    instantiate_model,
    measure_epoch_boundary,
    measure_loader_cost,
    record_achievable_mfu,
    record_limit,
    record_steady_state,
    record_window,
)
from gpuopt.measure import StopRule, make_clock, measure_step_flops, run_window, synchronize

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Workload:
    """The built pieces of a trial and the standard training step over them."""

    model: torch.nn.Module  # eager module (FLOP counting, checkpointing)
    forward: Callable[..., Any]  # the module, or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    precision: policies.PrecisionPolicy
    loss_name: str
    device: torch.device
    channels_last: bool
    non_blocking: bool
    nonfinite: NonFiniteLoss = field(default_factory=NonFiniteLoss)

    def to_device(self, inputs: torch.Tensor, targets: torch.Tensor) -> Batch:
        # non_blocking=True from pinned memory: the host does not wait for the copy. From pageable
        # memory, or with non_blocking=False, the host waits (a sync on the current stream).
        inputs = inputs.to(self.device, non_blocking=self.non_blocking)
        targets = targets.to(self.device, non_blocking=self.non_blocking)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            loss = compute_loss(self.loss_name, self.forward(inputs), targets)
        scaler = self.precision.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        loss = self.forward_backward(inputs, targets)
        scaler = self.precision.scaler
        if scaler is not None:
            # GradScaler.step reads found_inf on the host: a CPU-GPU sync point per step, the
            # real cost of fp16 loss scaling with a non-fused optimizer.
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.update(loss)

    def check_finite(self, phase: str) -> None:
        self.nonfinite.check(phase)


class BatchFeed:
    """Endless batches from the DataLoader (restarting it at each epoch end), already on the device,
    with what waiting for them cost (`wait`, reset at the window's start)."""

    def __init__(self, loader: Any, workload: Workload) -> None:
        self.loader = loader
        self.workload = workload
        self.iterator: Any = None
        self.batches = 0
        # On CUDA the starvation is read on the GPU timeline (events), whatever the copy mode.
        self.wait = InputWait(workload.device)

    def reset_counters(self) -> None:
        self.batches = 0
        self.wait.reset()

    def next(self) -> Batch:
        self.wait.fetch_started()
        if self.iterator is None:
            self.iterator = iter(self.loader)
        try:
            inputs, targets = next(self.iterator)
        except StopIteration:  # epoch end: a new iterator (new workers unless persistent_workers)
            self.iterator = iter(self.loader)
            inputs, targets = next(self.iterator)
        self.wait.fetch_ended()
        self.batches += 1
        self.wait.copy_started()
        batch = self.workload.to_device(inputs, targets)
        self.wait.copy_ended()
        return batch

    def close(self) -> None:
        """Stop the worker processes (they would compete with the ceiling measurement)."""
        iterator, self.iterator = self.iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def build(trial: Trial, trial_policies: TrialPolicies) -> tuple[Workload, BatchFeed]:
    """The model on the device, its optimizer and the DataLoader, seeded by `seed`."""
    spec, device = trial.spec, trial.device
    torch.manual_seed(spec.seed)
    dataset = instantiate_data(spec)
    model = instantiate_model(spec)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model._target_={spec.model['_target_']} built a {type(model).__name__}, not an nn.Module"
        )
    channels_last = bool(spec.model.get("channels_last", False))
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    optimizer = build_optimizer(spec, model.parameters())
    loader = build_loader(spec, dataset, device, trial.warnings)
    workload = Workload(
        model=model,
        forward=policies.compile_function(model, spec.compile),
        optimizer=optimizer,
        precision=trial_policies.precision,
        loss_name=spec.loss,
        device=device,
        channels_last=channels_last,
        non_blocking=spec.loader.non_blocking,
    )
    feed = BatchFeed(loader, workload)
    trial.resources += [workload, feed]
    trial.show("loader", loader)
    trial.show("model", model)
    trial.show("workload", workload)
    return workload, feed


def count_flops(trial: Trial, workload: Workload, batch: Batch) -> None:
    """flops_per_sample from one forward+backward of the eager module (outside the window), and
    the notes its MFU must be read with (HFU, fp32 attention on tensor cores)."""
    eager, workload.forward = workload.forward, workload.model

    def forward_backward() -> None:
        workload.forward_backward(*batch)

    try:
        flops = measure_step_flops(forward_backward)
    finally:
        workload.forward = eager
        workload.optimizer.zero_grad(set_to_none=True)
    batch_size = trial.spec.loader.batch_size
    if flops.hardware:
        trial.metrics.flops_per_sample = flops.model / batch_size
        trial.metrics.hardware_flops_per_sample = flops.hardware / batch_size
    trial.warnings += flop_notes(trial.spec, trial.device, trial.spec.precision.mode, flops)


def warm_up(
    trial: Trial, workload: Workload, feed: BatchFeed, first_batch: Batch, memory: MemoryBaseline
) -> None:
    """compile_time_s (the first step through torch.compile), then the warm-up steps (after the
    blocks the FLOP-count and compile steps left cached went back: `MemoryBaseline`)."""
    m, device = trial.metrics, trial.device
    # torch.compile compiles lazily on the first call: time that step apart (compile + one step).
    m.compile_time_s = 0.0
    if trial.spec.compile.mode != "off":
        started = time.perf_counter()
        workload.train_step(*first_batch)
        synchronize(device)
        m.compile_time_s = time.perf_counter() - started
    memory.release_cache()

    started = time.perf_counter()
    for _ in range(trial.spec.measure.warmup_steps):
        workload.train_step(*feed.next())
    synchronize(device)
    m.warmup_time_s = time.perf_counter() - started
    workload.check_finite("warm-up")


def timed_window(
    trial: Trial,
    workload: Workload,
    feed: BatchFeed,
    cache_policy: policies.CachePolicy,
    memory: MemoryBaseline,
    process_t0: float,
) -> None:
    """The timed window until the stop rule ends it, with the monitors on; its metrics."""
    spec, device = trial.spec, trial.device
    monitors = WindowMonitors(device, spec.measure.nvml_interval_s, trial.warnings)

    def step(index: int) -> None:
        workload.train_step(*feed.next())
        cache_policy.after_step(index)

    rule = StopRule.from_measure(spec.measure)
    feed.reset_counters()
    memory.window_starting()
    monitors.start()
    try:
        window = run_window(step, make_clock(device), rule)
    finally:
        nvml = monitors.stop()
    # clock.finish() synchronized: the window's work (and copies) has completed.
    record_window(
        trial.metrics,
        window,
        window.steps * spec.loader.batch_size,
        feed.wait.totals(),
        device,
        nvml,
        memory,
        spec.precision.mode,
        process_t0,
    )
    workload.check_finite("the timed window")


def beside_window(
    trial: Trial, feed: BatchFeed, fetch_wait_s: float
) -> tuple[EpochBoundary, float | None]:
    """After the window, outside any timed span: what an epoch boundary costs (a fresh epoch's
    first batch; the window's workers stopped first unless they persist, as between real epochs)
    and the input pipeline's cost per sample. The loader's workers are stopped afterwards."""
    loader, steps = feed.loader, trial.metrics.timed_steps or 0
    if not trial.spec.loader.persistent_workers:
        feed.close()
    boundary = measure_epoch_boundary(trial.spec, loader, fetch_wait_s, steps)
    feed.close()
    loader_cost = measure_loader_cost(loader) if trial.spec.measure.loader_cost else None
    return boundary, loader_cost


def compute_ceiling(
    trial: Trial, workload: Workload, feed: BatchFeed, batch: Batch
) -> CeilingReplay:
    """The same step on one batch already on the device, no loader: the most this step can do."""
    feed.close()
    batch_size = trial.spec.loader.batch_size

    def replay() -> int:
        workload.train_step(*batch)
        return batch_size

    ceiling = CeilingReplay.for_trial(trial.spec, trial.device)
    ceiling.run(replay)
    ceiling.record(trial.metrics)
    workload.check_finite("the compute-ceiling replay")
    return ceiling


def profiled_window(trial: Trial, workload: Workload, feed: BatchFeed) -> None:
    """A few steps under torch.profiler, outside the timed window (gpuopt.profile): the callables
    of the step annotated as its phases for these steps only."""
    from gpuopt.profile import Annotation, run_profiled_window

    phases = [
        Annotation(feed, "next", "next_batch"),
        Annotation(workload, "to_device", "h2d_copy"),
        Annotation(workload, "forward_backward", "forward_backward"),
        Annotation(workload, "forward", "forward"),
        Annotation(workload.optimizer, "step", "optimizer"),
    ]
    summary = run_profiled_window(
        lambda: workload.train_step(*feed.next()), phases, trial.device, trial.spec.profile
    )
    trial.profile = summary.to_dict()
    workload.check_finite("the profiled window")


def measure(trial: Trial, process_t0: float) -> None:
    """The engine (`gpuopt.engines.ENGINES["native"]`): fill `trial.metrics`, raising on failure
    (Diverged, OOM, errors: `gpuopt.engines.run_trial` classifies them)."""
    memory = MemoryBaseline.take(trial.device)
    trial_policies = apply_policies(trial.spec, trial.device)
    workload, feed = build(trial, trial_policies)

    first_batch = feed.next()
    if trial.spec.measure.count_flops:
        count_flops(trial, workload, first_batch)
    warm_up(trial, workload, feed, first_batch, memory)
    timed_window(trial, workload, feed, trial_policies.cache, memory, process_t0)
    window_fetch_s = feed.wait.fetch_s  # the window's, before the profiled steps fetch more
    if trial.spec.profile.enabled:  # before the epoch boundary and ceiling stop the loader
        profiled_window(trial, workload, feed)
    boundary, loader_cost = beside_window(trial, feed, window_fetch_s)
    record_steady_state(trial.metrics, boundary)
    ceiling = None
    if trial.spec.measure.ceiling:
        ceiling = compute_ceiling(trial, workload, feed, first_batch)
    record_limit(trial.metrics, trial.device, loader_cost, ceiling)
    if trial.spec.measure.peak_probe:
        record_achievable_mfu(trial.metrics, trial.device, trial.spec.precision.mode)
