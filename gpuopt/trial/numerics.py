"""The numerics guard: does a faster configuration still train the same model?

A trial that changes the math (precision, torch.compile, gradient accumulation, optimizer kernels,
channels_last) is checked once, outside its timed window: `guard.steps` (K) optimizer steps from
the seeded initial weights on the same fixed batches (the dataset's first K x global_batch samples,
in order: no shuffling, no workers), once the trial's way and once the fp32 reference way (fp32, no
compile, the whole global batch in one pass, PyTorch's default optimizer kernels; the same lr).

    loss_drift = max over the K steps of |loss_k - reference_loss_k| / |reference_loss_k|

Over `guard.loss_tolerance` the trial is infeasible (the sweeper tells Optuna a constraint named
`numerics`, gpuopt.sweeper.objectives) with this module's `GuardEvidence` as the why. fp16 loss
scaling that skips steps shows twice: in `skipped_steps`, and in the trajectory (a skipped step
does not lower the loss). A NaN/inf loss is an infinite drift.

What it does not prove: K steps are a short horizon. A small drift says the first steps follow the
fp32 trajectory on this data; it is not a convergence guarantee, and a drift that only appears after
thousands of steps (e.g. bf16 weight updates that round to nothing late in training) is not seen.

The reference depends only on the model, data, optimizer, loss, seed, global batch, K and device:
it is computed once per process and, inside a Hydra multirun, cached in the sweep dir
(`.numerics/<key>.json`), so a sweep's trials share it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuopt.core.spec import CompileConf, PrecisionConf, TrainConf, TrialSpec

if TYPE_CHECKING:
    import torch

    from gpuopt.core.result import TrialResult

log = logging.getLogger(__name__)

# The loss the relative deviation divides by is at least this (a loss near zero would make any
# rounding look like a huge relative drift).
MIN_REFERENCE_LOSS = 1e-6
CACHE_FOLDER = ".numerics"
_reference_cache: dict[str, list[float]] = {}


class NotGuarded(Exception):
    """The guard cannot run this configuration the way the trial trains it."""


@dataclass
class GuardEvidence:
    """What the guard measured for one trial: stored with the trial (user attr `numerics`)."""

    passed: bool
    loss_drift: float
    tolerance: float
    steps: int
    global_batch: int
    changes: list[str]  # what the trial changes in the math, e.g. ["precision bf16"]
    reference: str  # how the reference trained
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    skipped_steps: int = 0  # fp16 GradScaler steps skipped for inf/NaN gradients

    @property
    def summary(self) -> str:
        verdict = "within" if self.passed else "over"
        skipped = f", {self.skipped_steps} fp16 step(s) skipped" if self.skipped_steps else ""
        return (
            f"loss_drift {self.loss_drift:.3g} {verdict} tolerance {self.tolerance:g} over "
            f"{self.steps} steps ({', '.join(self.changes)} vs {self.reference}{skipped})"
        )


def math_changes(spec: TrialSpec) -> list[str]:
    """What this configuration changes in the training math relative to the fp32 reference."""
    changes = []
    if spec.precision.mode != "fp32":
        changes.append(f"precision {spec.precision.mode}")
    if spec.engine.name == "lightning" and spec.engine.precision not in (None, "32-true"):
        changes.append(f"engine.precision {spec.engine.precision}")
    if spec.compile.mode != "off":
        changes.append(f"compile {spec.compile.mode}")
    if spec.accumulation_steps > 1:
        changes.append(f"accumulation {spec.accumulation_steps} x {spec.micro_batch}")
    if spec.optimizer.fused or spec.optimizer.foreach is not None:
        changes.append(
            f"optimizer kernels fused={spec.optimizer.fused} foreach={spec.optimizer.foreach}"
        )
    if spec.model.get("channels_last"):
        changes.append("channels_last")
    return changes


def reference_spec(spec: TrialSpec) -> TrialSpec:
    """The fp32 reference of `spec`: the same global batch in one pass, no compile, default
    optimizer kernels, contiguous memory (the same model, data, optimizer, lr, loss and seed)."""
    optimizer = dataclasses.replace(spec.optimizer, fused=None, foreach=None)
    if optimizer.reference_batch is None:  # keep the lr factor the trial had (1.0)
        optimizer = dataclasses.replace(optimizer, reference_batch=spec.global_batch)
    return dataclasses.replace(
        spec,
        precision=PrecisionConf(mode="fp32"),
        compile=CompileConf(mode="off"),
        loader=dataclasses.replace(spec.loader, batch_size=spec.global_batch),
        train=TrainConf(global_batch=None),
        engine=dataclasses.replace(spec.engine, name="native", precision=None),
        optimizer=optimizer,
        model={**spec.model, "channels_last": False}
        if "channels_last" in spec.model
        else spec.model,
    )


def loss_drift(losses: list[float], reference: list[float]) -> float:
    """The largest relative deviation of the loss from the reference's over the steps (inf when a
    loss is NaN/inf)."""
    drift = 0.0
    for loss, ref in zip(losses, reference, strict=True):
        if not (math.isfinite(loss) and math.isfinite(ref)):
            return math.inf
        drift = max(drift, abs(loss - ref) / max(abs(ref), MIN_REFERENCE_LOSS))
    return drift


def fixed_batches(spec: TrialSpec, steps: int) -> list[Any]:
    """K global batches of the dataset's first samples, in order (CPU tensors)."""
    from torch.utils.data import default_collate

    from gpuopt.engines._common import instantiate_data

    dataset = instantiate_data(spec)
    size, batch = len(dataset), spec.global_batch
    return [
        default_collate([dataset[(step * batch + i) % size] for i in range(batch)])
        for step in range(steps)
    ]


def loss_trajectory(
    spec: TrialSpec, device: torch.device, batches: list[Any]
) -> tuple[list[float], int]:
    """(the loss of each of the K optimizer steps, fp16 steps skipped) training `spec`'s way from
    the seeded initial weights: gpuopt's own step (gpuopt.engines.native.Workload)."""
    import torch

    from gpuopt.engines._common import build_loss, build_optimizer, instantiate_model
    from gpuopt.engines.native import Workload
    from gpuopt.trial import knobs

    torch.manual_seed(spec.seed)
    model = instantiate_model(spec)
    if hasattr(model, "training_step"):  # a LightningModule: its own step, not gpuopt's
        raise NotGuarded(f"{type(model).__name__} trains through its own training_step")
    model = model.to(device)
    channels_last = bool(spec.model.get("channels_last", False))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    precision = knobs.precision_policy(spec.precision, device)
    workload = Workload(
        model=model,
        forward=knobs.compile_function(model, spec.compile),
        optimizer=build_optimizer(spec, model.parameters()),
        precision=precision,
        loss=build_loss(spec),
        device=device,
        channels_last=channels_last,
        non_blocking=False,
        accumulation_steps=spec.accumulation_steps,
    )
    if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
        kind = type(batches[0]).__name__ if batches else "no"
        raise NotGuarded(f"the guard splits (inputs, targets) batches into micro-batches: {kind}")
    losses, skipped = [], 0
    for inputs, targets in batches:
        micro = [
            workload.to_device((x, y))
            for x, y in zip(
                inputs.split(spec.micro_batch), targets.split(spec.micro_batch), strict=True
            )
        ]
        scale = precision.scaler.get_scale() if precision.scaler is not None else None
        losses.append(float(workload.train_step(micro).detach()))
        if scale is not None and precision.scaler.get_scale() < scale:
            skipped += 1  # GradScaler lowers its scale exactly when it skipped the step
    return losses, skipped


def _reference_key(reference: TrialSpec, device: torch.device, steps: int) -> str:
    keep = {
        "model": reference.model,
        "data": reference.data,
        "optimizer": asdict(reference.optimizer),
        "loss": reference.loss,
        "seed": reference.seed,
        "global_batch": reference.global_batch,
        "steps": steps,
        "device": device.type,
    }
    return hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sweep_cache_dir() -> Path | None:
    """The sweep dir's `.numerics` folder inside a Hydra multirun, else None (process cache only)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        config = HydraConfig.get()
        if str(config.mode) != "RunMode.MULTIRUN":
            return None
        return Path(str(config.sweep.dir)) / CACHE_FOLDER
    except Exception:  # no Hydra, or a config without a sweep dir
        return None


def reference_losses(
    spec: TrialSpec, device: torch.device, batches: list[Any], cache_dir: Path | None
) -> list[float]:
    """The fp32 reference trajectory: from this process's cache, the sweep dir's, or trained now."""
    reference = reference_spec(spec)
    key = _reference_key(reference, device, len(batches))
    if key in _reference_cache:
        return _reference_cache[key]
    path = cache_dir / f"{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            _reference_cache[key] = list(json.loads(path.read_text())["losses"])
            return _reference_cache[key]
        except (OSError, ValueError, KeyError):
            pass  # a half-written or foreign file: recompute
    losses, _ = loss_trajectory(reference, device, batches)
    _reference_cache[key] = losses
    if path is not None:
        _write_atomically(path, {"losses": losses})
    return losses


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Workers of one sweep may write the same key at once: write aside, then rename."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("numerics reference not cached: %s", exc)


def check(
    spec: TrialSpec,
    device: torch.device,
    changes: list[str] | None = None,
    cache_dir: Path | None = None,
) -> GuardEvidence:
    """Train K steps `spec`'s way and the fp32 reference way; compare the loss trajectories.
    The reference runs first, so the process's matmul precision ends as the trial's."""
    steps = spec.guard.steps
    batches = fixed_batches(spec, steps)
    reference = reference_losses(spec, device, batches, cache_dir)
    losses, skipped = loss_trajectory(spec, device, batches)
    drift = loss_drift(losses, reference)
    return GuardEvidence(
        passed=drift <= spec.guard.loss_tolerance,
        loss_drift=drift,
        tolerance=spec.guard.loss_tolerance,
        steps=steps,
        global_batch=spec.global_batch,
        changes=changes if changes is not None else math_changes(spec),
        reference=f"fp32 reference (global batch {spec.global_batch} in one pass, no compile)",
        losses=losses,
        reference_losses=reference,
        skipped_steps=skipped,
    )


def guard_result(spec: TrialSpec, device: torch.device | None, result: TrialResult) -> TrialResult:
    """After a measured trial (its memory released): run the guard when it is on, the trial ended
    ok and it changes the math; the evidence goes to `result.numerics` and `loss_drift`."""
    changes = math_changes(spec)
    if not spec.guard.enabled or not changes or not result.ok:
        return result
    from gpuopt.engines._common import is_oom
    from gpuopt.env import resolve_device

    try:
        if spec.engine.name == "lightning" and spec.engine.precision is not None:
            raise NotGuarded(f"engine.precision={spec.engine.precision} has no gpuopt equivalent")
        device = device if device is not None else resolve_device(spec.device.type)
        evidence = check(spec, device, changes, sweep_cache_dir())
    except Exception as exc:  # the guard must not turn a measured trial into an error
        if not isinstance(exc, NotGuarded) and not is_oom(exc):
            log.warning("numerics guard failed", exc_info=exc)
        result.warnings.append(f"numerics guard not run: {type(exc).__name__}: {exc}")
        return result
    result.metrics.loss_drift = evidence.loss_drift
    result.numerics = {**asdict(evidence), "summary": evidence.summary}
    if not evidence.passed:
        result.warnings.append(f"numerics: {evidence.summary}")
    return result
