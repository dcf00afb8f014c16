"""The native engine (`engine=native`): gpuopt's own training loop over the workload a `TrialSpec`
describes (the workload contract: `gpuopt.engines._common`).

The step is the standard one: forward (under autocast for fp16/bf16), loss, backward (through a
GradScaler for fp16), optimizer step, zero_grad(set_to_none=True).

Order of work, each part timed apart: build -> FLOP count (one step, outside the window) -> first
step through torch.compile (compile_time_s) -> warm-up (warmup_time_s) -> timed window (monitors on)
-> compute ceiling (the first batch replayed on the device, no loader).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuopt import policies
from gpuopt.engines._common import (
    BatchFeed,
    CeilingReplay,
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
    instantiate_data,
    instantiate_model,
    measure_timed_window,
    model_loss,
    move_batch,
)
from gpuopt.measure import count_step_flops, synchronize

# A batch of any structure the model contract accepts: (inputs, targets), longer tuples, dicts
# (Hugging Face style), nested containers (gpuopt.engines._common.model_loss).
Batch = Any


@dataclass
class Workload:
    """The built pieces of a trial and the standard training step over them."""

    model: torch.nn.Module  # eager module (FLOP counting, checkpointing)
    forward: Callable[..., Any]  # the module, or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    precision: policies.PrecisionPolicy
    loss: str | LossFunction  # a built-in loss name, or the user's loss function
    device: torch.device
    channels_last: bool
    non_blocking: bool
    nonfinite: NonFiniteLoss = field(default_factory=NonFiniteLoss)

    def to_device(self, batch: Batch) -> Batch:
        # non_blocking=True from pinned memory: the host does not wait for the copy. From pageable
        # memory, or with non_blocking=False, the host waits (a sync on the current stream). The
        # DataLoader pinned the batch already when loader.pin_memory is on.
        return move_batch(batch, self.device, self.non_blocking, channels_last=self.channels_last)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        with self.precision.autocast():
            loss = model_loss(self.forward, batch, self.loss)
        scaler = self.precision.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    def train_step(self, batch: Batch) -> None:
        loss = self.forward_backward(batch)
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
        loss=build_loss(spec),
        device=device,
        channels_last=channels_last,
        non_blocking=spec.loader.non_blocking,
    )
    # A synchronous H2D copy on CUDA also waits for queued compute: the feed times it on the stream.
    time_copies = device.type == "cuda" and not workload.non_blocking
    feed = BatchFeed(loader, workload.to_device, time_copies)
    trial.resources += [workload, feed]
    trial.show("loader", loader)
    trial.show("model", model)
    trial.show("workload", workload)
    return workload, feed


def count_flops(trial: Trial, workload: Workload, batch: Batch) -> None:
    """flops_per_sample from one forward+backward of the eager module (outside the window)."""
    eager, workload.forward = workload.forward, workload.model

    def forward_backward() -> None:
        workload.forward_backward(batch)

    try:
        flops = count_step_flops(forward_backward)
    finally:
        workload.forward = eager
        workload.optimizer.zero_grad(set_to_none=True)
    trial.metrics.flops_per_sample = flops / batch_samples(batch) if flops else None


def warm_up(trial: Trial, workload: Workload, feed: BatchFeed, first_batch: Batch) -> None:
    """compile_time_s (the first step through torch.compile), then the warm-up steps."""
    m, device = trial.metrics, trial.device
    # torch.compile compiles lazily on the first call: time that step apart (compile + one step).
    m.compile_time_s = 0.0
    if trial.spec.compile.mode != "off":
        started = time.perf_counter()
        workload.train_step(first_batch)
        synchronize(device)
        m.compile_time_s = time.perf_counter() - started

    started = time.perf_counter()
    for _ in range(trial.spec.measure.warmup_steps):
        workload.train_step(feed.next())
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
    precision_mode = trial.spec.precision.mode
    measure_timed_window(
        trial,
        workload.train_step,
        feed,
        memory,
        precision_mode,
        process_t0,
        cache_policy.after_step,
    )
    workload.check_finite("the timed window")


def compute_ceiling(trial: Trial, workload: Workload, feed: BatchFeed, batch: Batch) -> None:
    """The same step on one batch already on the device, no loader: the most this step can do."""
    feed.close()
    samples = batch_samples(batch)

    def replay() -> int:
        workload.train_step(batch)
        return samples

    ceiling = CeilingReplay.for_trial(trial.spec, trial.device)
    ceiling.run(replay)
    ceiling.record(trial.metrics)
    workload.check_finite("the compute-ceiling replay")


def measure(trial: Trial, process_t0: float) -> None:
    """The engine (`gpuopt.engines.ENGINES["native"]`): fill `trial.metrics`, raising on failure
    (Diverged, OOM, errors: `gpuopt.engines.run_trial` classifies them)."""
    memory = MemoryBaseline.take(trial.device)
    trial_policies = apply_policies(trial.spec, trial.device)
    workload, feed = build(trial, trial_policies)

    first_batch = feed.next()
    if trial.spec.measure.count_flops:
        count_flops(trial, workload, first_batch)
    warm_up(trial, workload, feed, first_batch)
    timed_window(trial, workload, feed, trial_policies.cache, memory, process_t0)
    if trial.spec.measure.ceiling:
        compute_ceiling(trial, workload, feed, first_batch)
