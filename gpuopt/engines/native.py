"""The native engine (`engine=native`): gpuopt's own training loop over the workload a `TrialSpec`
describes (the workload contract: `gpuopt.engines._common`).

The step is the standard one: forward (under autocast for fp16/bf16), loss, backward (through a
GradScaler for fp16), optimizer step, zero_grad(set_to_none=True). With `train.global_batch` set,
one step is `accumulation_steps` micro-batches of forward/backward, each loss divided by that count
(the built-in losses are means over equal micro-batches, so the accumulated gradient is the full
batch's mean gradient), then one optimizer step: a timed step is an optimizer step.

Order of work, each part timed apart: build -> FLOP count (one step, outside the window) -> first
step through torch.compile (compile_time_s) -> warm-up (warmup_time_s) -> timed window (monitors on;
the loader's one epoch lasts the whole trial) -> an epoch boundary and the input pipeline's cost per
sample, measured apart -> compute ceiling (the first batch replayed on the device, no loader) ->
the machine's limit -> the measured matmul peak (cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuopt.engines._common import (
    BatchFeed,
    CeilingReplay,
    EpochBoundary,
    LossFunction,
    MemoryBaseline,
    NonFiniteLoss,
    Trial,
    TrialPolicies,
    apply_policies,
    batch_samples,
    build_loader,
    build_loss,
    build_optimizer,
    flop_notes,
    instantiate_data,
    instantiate_model,
    measure_epoch_boundary,
    measure_loader_cost,
    measure_timed_window,
    model_loss,
    move_batch,
    record_achievable_mfu,
    record_batches,
    record_limit,
    record_steady_state,
)
from gpuopt.trial import knobs
from gpuopt.trial.measure import measure_step_flops, synchronize

# A batch of any structure the model contract accepts: (inputs, targets), longer tuples, dicts
# (Hugging Face style), nested containers (gpuopt.engines._common.model_loss).
Batch = Any


@dataclass
class Workload:
    """The built pieces of a trial and the standard training step over them."""

    model: torch.nn.Module  # eager module (FLOP counting, checkpointing)
    forward: Callable[..., Any]  # the module, or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    precision: knobs.PrecisionPolicy
    loss: str | LossFunction  # a built-in loss name, or the user's loss function
    device: torch.device
    channels_last: bool
    non_blocking: bool
    accumulation_steps: int = 1  # micro-batches per optimizer step
    nonfinite: NonFiniteLoss = field(default_factory=NonFiniteLoss)

    def to_device(self, batch: Batch) -> Batch:
        # non_blocking=True from pinned memory: the host does not wait for the copy. From pageable
        # memory, or with non_blocking=False, the host waits (a sync on the current stream). The
        # DataLoader pinned the batch already when loader.pin_memory is on.
        return move_batch(batch, self.device, self.non_blocking, channels_last=self.channels_last)

    def forward_backward(self, batch: Batch, share: float = 1.0) -> torch.Tensor:
        """Forward and backward of one (micro-)batch; `share` scales the loss (1/accumulation)."""
        with self.precision.autocast():
            loss = model_loss(self.forward, batch, self.loss)
        scaled = loss * share if share != 1.0 else loss
        scaler = self.precision.scaler
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        return loss

    def train_step(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """One optimizer step over `micro_batches` (accumulation_steps of them); returns the step's
        loss (the mean of the micro-batch losses: the full batch's loss), on the device."""
        share = 1.0 / len(micro_batches)
        losses = [self.forward_backward(batch, share) for batch in micro_batches]
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
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
        return loss

    def check_finite(self, phase: str) -> None:
        self.nonfinite.check(phase)


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
        forward=knobs.compile_function(model, spec.compile),
        optimizer=optimizer,
        precision=trial_policies.precision,
        loss=build_loss(spec),
        device=device,
        channels_last=channels_last,
        non_blocking=spec.loader.non_blocking,
        accumulation_steps=spec.accumulation_steps,
    )
    feed = BatchFeed(loader, workload.to_device, device, accumulation_steps=spec.accumulation_steps)
    trial.resources += [workload, feed]
    trial.show("loader", loader)
    trial.show("model", model)
    trial.show("workload", workload)
    return workload, feed


def count_flops(trial: Trial, workload: Workload, batch: Batch) -> None:
    """flops_per_sample from one forward+backward of the eager module on one micro-batch
    (outside the window), and the notes its MFU must be read with (fp32 attention on tensor
    cores)."""
    eager, workload.forward = workload.forward, workload.model

    def forward_backward() -> None:
        workload.forward_backward(batch)

    try:
        flops = measure_step_flops(forward_backward)
    finally:
        workload.forward = eager
        workload.optimizer.zero_grad(set_to_none=True)
    batch_size = batch_samples(batch)
    if flops.hardware:
        trial.metrics.flops_per_sample = flops.model / batch_size
        trial.metrics.hardware_flops_per_sample = flops.hardware / batch_size
    trial.warnings += flop_notes(trial.spec, trial.device, trial.spec.precision.mode, flops)


def warm_up(
    trial: Trial,
    workload: Workload,
    feed: BatchFeed,
    first_step: list[Batch],
    memory: MemoryBaseline,
) -> None:
    """compile_time_s (the first step through torch.compile), then the warm-up steps (after the
    blocks the FLOP-count and compile steps left cached went back: `MemoryBaseline`)."""
    m, device = trial.metrics, trial.device
    # torch.compile compiles lazily on the first call: time that step apart (compile + one step).
    m.compile_time_s = 0.0
    if trial.spec.compile.mode != "off":
        started = time.perf_counter()
        workload.train_step(first_step)
        synchronize(device)
        m.compile_time_s = time.perf_counter() - started
    memory.release_cache()

    started = time.perf_counter()
    for _ in range(trial.spec.measure.warmup_steps):
        workload.train_step(feed.next_step())
    synchronize(device)
    m.warmup_time_s = time.perf_counter() - started
    workload.check_finite("warm-up")


def timed_window(
    trial: Trial,
    workload: Workload,
    feed: BatchFeed,
    cache_policy: knobs.CachePolicy,
    memory: MemoryBaseline,
    process_t0: float,
) -> None:
    """The timed window until the stop rule ends it, with the monitors on; its metrics."""
    measure_timed_window(
        trial,
        lambda: workload.train_step(feed.next_step()),
        feed,
        memory,
        trial.spec.precision.mode,
        process_t0,
        cache_policy.after_step,
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


def profiled_window(trial: Trial, workload: Workload, feed: BatchFeed) -> None:
    """A few steps under torch.profiler, outside the timed window (gpuopt.trial.profile): the callables
    of the step annotated as its phases for these steps only."""
    from gpuopt.trial.profile import Annotation, run_profiled_window

    phases = [
        Annotation(feed, "next", "next_batch"),
        Annotation(workload, "to_device", "h2d_copy"),
        Annotation(workload, "forward_backward", "forward_backward"),
        Annotation(workload, "forward", "forward"),
        Annotation(workload.optimizer, "step", "optimizer"),
    ]
    summary = run_profiled_window(
        lambda: workload.train_step(feed.next_step()), phases, trial.device, trial.spec.profile
    )
    trial.profile = summary.to_dict()
    workload.check_finite("the profiled window")


def measure(trial: Trial, process_t0: float) -> None:
    """The engine (`gpuopt.engines.ENGINES["native"]`): fill `trial.metrics`, raising on failure
    (Diverged, OOM, errors: `gpuopt.engines.run_trial` classifies them)."""
    memory = MemoryBaseline.take(trial.device)
    trial_policies = apply_policies(trial.spec, trial.device)
    workload, feed = build(trial, trial_policies)

    record_batches(trial)
    first_step = feed.next_step()
    if trial.spec.measure.count_flops:
        count_flops(trial, workload, first_step[0])
    warm_up(trial, workload, feed, first_step, memory)
    timed_window(trial, workload, feed, trial_policies.cache, memory, process_t0)
    window_fetch_s = feed.wait.fetch_s  # the window's, before the profiled steps fetch more
    if trial.spec.profile.enabled:  # before the epoch boundary and ceiling stop the loader
        profiled_window(trial, workload, feed)
    boundary, loader_cost = beside_window(trial, feed, window_fetch_s)
    record_steady_state(trial.metrics, boundary)
    ceiling = None
    if trial.spec.measure.ceiling:
        ceiling = compute_ceiling(trial, workload, feed, first_step)
    record_limit(trial.metrics, trial.device, loader_cost, ceiling)
    if trial.spec.measure.peak_probe:
        record_achievable_mfu(trial.metrics, trial.device, trial.spec.precision.mode)
