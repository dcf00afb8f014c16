"""The numerics guard: does a faster configuration still train the same model?

A trial that changes the math (precision, compile, accumulation, optimizer kernels,
channels_last) is checked outside its timed window: `guard.steps` (K) optimizer steps from the
seeded weights on the same fixed batches, once the trial's way and once the fp32 reference way.

    loss_drift = max over the K steps of |loss_k - reference_loss_k| / |reference_loss_k|

Over `guard.loss_tolerance` the trial is infeasible (constraint `numerics`). What it does not
prove: K steps are a short horizon; a drift that only appears after thousands of steps (e.g. bf16
weight updates that round to nothing late in training) is not seen.

The reference is computed once per process and, in a Hydra multirun, cached in the sweep dir
(`.numerics/<key>.json`). This module decides; the K steps are trained by gpuopt.engines._guard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuopt.core import knobs
from gpuopt.core.machine_cache import read_json, write_json
from gpuopt.core.spec import CompileConf, DistributedConf, PrecisionConf, TrainConf, TrialSpec
from gpuopt.trial.failures import is_oom

if TYPE_CHECKING:
    import torch

    from gpuopt.trial.context import Trial

log = logging.getLogger(__name__)

# The relative deviation divides by at least this (near zero any rounding looks like a huge drift).
MIN_REFERENCE_LOSS = 1e-6
CACHE_FOLDER = ".numerics"
CACHE_ENV = "GPUOPT_GUARD_CACHE"  # a distributed trial's ranks: their trial's `sweep_cache_dir`
# The reference trajectories this process trained or read, by `reference_key`.
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
    # The trial's own global batch, where the guard checked at another (`guarded_spec`).
    trial_global_batch: int | None = None

    @property
    def summary(self) -> str:
        verdict = "within" if self.passed else "over"
        skipped = f", {self.skipped_steps} fp16 step(s) skipped" if self.skipped_steps else ""
        apart = (
            f"; checked at global batch {self.global_batch}, the trial trains "
            f"{self.trial_global_batch}"
            if self.trial_global_batch not in (None, self.global_batch)
            else ""
        )
        return (
            f"loss_drift {self.loss_drift:.3g} {verdict} tolerance {self.tolerance:g} over "
            f"{self.steps} steps ({', '.join(self.changes)} vs {self.reference}{skipped}{apart})"
        )


def math_changes(spec: TrialSpec) -> list[str]:
    """What this configuration changes in the training math relative to the fp32 reference (the
    knob catalogue's `Knob.numerics` checks, each change once)."""
    named = (knob.numerics(spec) for knob in knobs.KNOBS if knob.numerics is not None)
    return list(dict.fromkeys(change for change in named if change))


def guarded_spec(spec: TrialSpec) -> TrialSpec:
    """The configuration the guard trains: the trial's own, or its math changes at
    `guard.global_batch` (a sweep sets the baseline's). Why: a batch change is reported apart
    (gpuopt.study.rules.training_change), and at the baseline's batch one fp32 reference serves
    every trial, where one per searched batch cost a cnn sweep 10-24 s on the 2-core CPU
    (docs/benchmarks.md). A trial that accumulates or spans ranks keeps its own batch: its split
    is what the guard checks."""
    batch = spec.guard.global_batch
    if batch is None or batch == spec.global_batch:
        return spec
    if spec.accumulation_steps > 1 or spec.distributed.kind != "none":
        return spec
    return dataclasses.replace(
        spec,
        loader=dataclasses.replace(spec.loader, batch_size=batch),
        train=TrainConf(global_batch=None),
    )


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
        distributed=DistributedConf(),  # one process: a distributed job's math on its global batch
        optimizer=optimizer,
        model={**spec.model, "channels_last": False}
        if "channels_last" in spec.model
        else spec.model,
    )


def loss_drift(losses: list[float], reference: list[float]) -> float:
    """The largest relative deviation of the loss from the reference's (inf for a NaN/inf loss)."""
    drift = 0.0
    for loss, ref in zip(losses, reference, strict=True):
        if not (math.isfinite(loss) and math.isfinite(ref)):
            return math.inf
        drift = max(drift, abs(loss - ref) / max(abs(ref), MIN_REFERENCE_LOSS))
    return drift


def reference_key(
    reference: TrialSpec, device: torch.device, steps: int, settings: dict[str, Any] | None = None
) -> str:
    """What the reference trajectory depends on, hashed: its cache key (`reference_spec` fixes
    everything else; `settings`: the process-wide ones it trains under, e.g. its threads)."""
    keep = {
        "model": reference.model,
        "data": reference.data,
        "optimizer": asdict(reference.optimizer),
        "loss": reference.loss,
        "seed": reference.seed,
        "global_batch": reference.global_batch,
        "steps": steps,
        "device": device.type,
        "settings": settings or {},
    }
    return hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sweep_cache_dir() -> Path | None:
    """The sweep dir's `.numerics` folder inside a Hydra multirun, else None; in a distributed
    trial's rank (no Hydra there), the one its trial handed down ($GPUOPT_GUARD_CACHE)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
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


def cached_reference(key: str, cache_dir: Path | None) -> list[float] | None:
    """The reference trajectory under `key`, from this process's cache or the sweep dir's."""
    if key not in _reference_cache and cache_dir is not None:
        losses = read_json(cache_dir / f"{key}.json").get("losses")
        if isinstance(losses, list):  # else none, or a half-written or foreign file: recompute
            _reference_cache[key] = losses
    return _reference_cache.get(key)


def store_reference(key: str, losses: list[float], cache_dir: Path | None) -> None:
    """Keep a trained reference trajectory for this process and, in a multirun, the sweep (workers
    may write the same key at once: `write_json` writes aside, then renames)."""
    _reference_cache[key] = losses
    if cache_dir is not None:
        write_json(cache_dir / f"{key}.json", {"losses": losses})


def evidence(
    spec: TrialSpec,
    losses: list[float],
    reference: list[float],
    skipped_steps: int,
    changes: list[str] | None = None,
    trial_global_batch: int | None = None,
) -> GuardEvidence:
    """The guard's verdict (`spec`: what it trained; `trial_global_batch`: the trial's own)."""
    drift = loss_drift(losses, reference)
    return GuardEvidence(
        passed=drift <= spec.guard.loss_tolerance,
        loss_drift=drift,
        tolerance=spec.guard.loss_tolerance,
        steps=spec.guard.steps,
        global_batch=spec.global_batch,
        changes=changes if changes is not None else math_changes(spec),
        reference=f"fp32 reference (global batch {spec.global_batch} in one pass, no compile)",
        losses=losses,
        reference_losses=reference,
        skipped_steps=skipped_steps,
        trial_global_batch=trial_global_batch,
    )


def changes_to_guard(spec: TrialSpec) -> list[str]:
    """What the guard checks in this trial (`math_changes`), none when the guard is off; raises
    NotGuarded for a configuration it cannot train gpuopt's way."""
    changes = math_changes(spec) if spec.guard.enabled else []
    if changes and spec.engine.name == "lightning" and spec.engine.precision is not None:
        raise NotGuarded(f"engine.precision={spec.engine.precision} has no gpuopt equivalent")
    return changes


def record_evidence(trial: Trial, found: GuardEvidence) -> None:
    """The evidence on the trial, and a warning when it is over the tolerance."""
    trial.metrics.loss_drift = found.loss_drift
    trial.numerics = {**asdict(found), "summary": found.summary}
    if not found.passed:
        trial.warnings.append(f"numerics: {found.summary}")


def record_not_run(trial: Trial, exc: Exception, changes: list[str] | None = None) -> None:
    """Why the guard did not run, as a warning (it never turns a measured trial into an error) and
    as evidence with `passed` None, so a trial whose math changed unchecked is never called the
    same training (gpuopt.study.rules.same_training)."""
    if not isinstance(exc, NotGuarded) and not is_oom(exc):
        log.warning("numerics guard failed", exc_info=exc)
    why = f"{type(exc).__name__}: {exc}"
    trial.warnings.append(f"numerics guard not run: {why}")
    trial.numerics = {"passed": None, "not_run": why, "changes": list(changes or [])}
