"""gpuopt's own training step (`Workload`): forward (under autocast for fp16/bf16), loss, backward
(through a GradScaler for fp16), optimizer step, zero_grad(set_to_none=True). With accumulation,
one step is `accumulation_steps` micro-batches, each loss divided by that count (the built-in
losses are means over equal micro-batches, so the accumulated gradient is the full batch's).

Not part of the native engine: the numerics guard's trajectories (also for Lightning trials)
train with this same step, and engines never import each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuopt.core.spec import TrialSpec
from gpuopt.engines._batches import move_batch
from gpuopt.engines._build import build_loss, build_optimizer
from gpuopt.engines._distributed import Ranks
from gpuopt.engines._loss import LossFunction, model_loss
from gpuopt.trial import library_bugs, policies
from gpuopt.trial.failures import NonFiniteLoss

Batch = Any  # any structure the model contract accepts (gpuopt.engines._loss.model_loss)


@dataclass
class Workload:
    model: torch.nn.Module  # eager module (FLOP counting, checkpointing)
    forward: Callable[..., Any]  # the module, or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    precision: policies.PrecisionPolicy
    loss: str | LossFunction  # a built-in loss name, or the user's loss function
    device: torch.device
    channels_last: bool
    non_blocking: bool
    accumulation_steps: int = 1  # micro-batches per optimizer step
    nonfinite: NonFiniteLoss = field(default_factory=NonFiniteLoss)
    # Wraps each micro-batch but the last of a step: a distributed trial's no gradient reduction
    # yet (gpuopt.engines._distributed); nothing in one process.
    accumulating: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    # The steps' losses since the last check, summed on the device (`_watch_loss`).
    loss_sum: torch.Tensor | None = field(default=None, repr=False)

    def to_device(self, batch: Batch) -> Batch:
        # Only from pinned memory (loader.pin_memory) does non_blocking spare the host a sync.
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
        """One optimizer step over `micro_batches`; the step's loss (their mean), on the device."""
        if len(micro_batches) == 1:
            loss = self.forward_backward(micro_batches[0])
        else:
            loss = self._accumulate(micro_batches)
        scaler = self.precision.scaler
        if scaler is not None:
            # GradScaler.step reads found_inf on the host: a CPU-GPU sync point per step, the
            # real cost of fp16 loss scaling with a non-fused optimizer.
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._watch_loss(loss)
        return loss

    def _accumulate(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """Each micro-batch's forward/backward, all but the last under `accumulating`."""
        share, last = 1.0 / len(micro_batches), len(micro_batches) - 1
        losses = []
        for index, batch in enumerate(micro_batches):
            with self.accumulating() if index < last else contextlib.nullcontext():
                losses.append(self.forward_backward(batch, share))
        return torch.stack(losses).mean()

    def _watch_loss(self, loss: torch.Tensor) -> None:
        """One in-place add per step, no host sync: a NaN or inf loss leaves the sum NaN/inf for
        good (NonFiniteLoss.update per step costs three ops and two allocations). Summed in
        float32 at least: a half-precision sum of finite losses would overflow."""
        loss = loss.detach()
        if self.loss_sum is None:
            self.loss_sum = torch.zeros_like(
                loss, dtype=torch.promote_types(loss.dtype, torch.float32)
            )
        self.loss_sum.add_(loss)

    def check_finite(self, phase: str) -> None:
        """Raise Diverged if any step's loss so far was NaN/inf (a CPU-GPU sync: window ends only)."""
        if self.loss_sum is not None:
            self.nonfinite.update(self.loss_sum)
            self.loss_sum.zero_()
        self.nonfinite.check(phase)


def build_workload(
    spec: TrialSpec,
    model: torch.nn.Module,
    device: torch.device,
    precision: policies.PrecisionPolicy,
    non_blocking: bool,
    ranks: Ranks | None = None,
) -> Workload:
    """`model` on the device, in training mode, with its optimizer, compile wrapper and loss. Under
    `ranks` DDP or FSDP2 wraps the model before the optimizer sees it."""
    channels_last = bool(spec.model.get("channels_last", False))
    model = model.to(device)
    if channels_last:
        library_bugs.check_channels_last(model, device, spec.precision.mode)
        model = model.to(memory_format=torch.channels_last)
    if ranks is not None:
        model = ranks.wrap(model)
    model.train()
    return Workload(
        model=model,
        forward=policies.compile_function(model, spec.compile),
        optimizer=build_optimizer(spec, model.parameters()),
        precision=precision,
        loss=build_loss(spec),
        device=device,
        channels_last=channels_last,
        non_blocking=non_blocking,
        accumulation_steps=spec.accumulation_steps,
        accumulating=ranks.no_sync if ranks is not None else contextlib.nullcontext,
    )
