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

The reference depends only on the model, data, optimizer, loss, seed, global batch, K, device and
the thread count it trains with (every usable CPU, whatever the trial's: `reference_key`): it is
computed once per process (`_reference_cache`: a race process's finalists, an in-process sweep's
trials share it, bit-identical to a recomputation) and, inside a Hydra multirun, cached in the
sweep dir (`.numerics/<key>.json`), so a sweep's trials share it.

This module holds what the guard decides (which trials it checks, the reference's spec, the drift,
the cache of reference trajectories, the evidence on the trial); the training of the K steps is the
engines' side (gpuopt.engines._guard, a step the engines ask for once a trial measured ok). It
imports no engine.
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

from gpuopt.core import knobs
from gpuopt.core.spec import CompileConf, DistributedConf, PrecisionConf, TrainConf, TrialSpec
from gpuopt.trial.failures import is_oom

if TYPE_CHECKING:
    import torch

    from gpuopt.trial.context import Trial

log = logging.getLogger(__name__)

# The loss the relative deviation divides by is at least this (a loss near zero would make any
# rounding look like a huge relative drift).
MIN_REFERENCE_LOSS = 1e-6
CACHE_FOLDER = ".numerics"
# The reference trajectories this process trained or read, by `reference_key` (the trial process's
# "do it once": reused by every later trial of the same reference in this process).
_reference_cache: dict[str, list[float]] = {}
_rank_cache_dir: Path | None = None  # set in a distributed trial's ranks (inherit_cache_dir)


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
    """What this configuration changes in the training math relative to the fp32 reference: the
    knob catalogue's NUMERICS keys, each named by its record's check (`Knob.numerics`), a change
    of several keys (a distributed job) once."""
    named = (knob.numerics(spec) for knob in knobs.KNOBS if knob.numerics is not None)
    return list(dict.fromkeys(change for change in named if change))


def guarded_spec(spec: TrialSpec) -> TrialSpec:
    """The configuration the guard trains: the trial's own, or its math changes at
    `guard.global_batch` where that differs from the trial's global batch (a sweep sets the
    baseline's). Why: a batch change is a training change of its own, reported apart with its
    learning-rate advice (gpuopt.study.rules.training_change); the guard asks whether precision,
    compile, kernels or layout keep the math, and at the baseline's batch one fp32 reference
    serves every trial, where one per searched batch cost a cnn sweep 10-24 s of fp32 steps on the
    2-core CPU (docs/benchmarks.md). The same lr factor rule applies at that batch (the sweep's
    reference batch is the baseline's: the baseline's lr). A trial that accumulates
    micro-batches, or spans ranks, keeps its own batch: its split is what the guard checks."""
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
    """The largest relative deviation of the loss from the reference's over the steps (inf when a
    loss is NaN/inf)."""
    drift = 0.0
    for loss, ref in zip(losses, reference, strict=True):
        if not (math.isfinite(loss) and math.isfinite(ref)):
            return math.inf
        drift = max(drift, abs(loss - ref) / max(abs(ref), MIN_REFERENCE_LOSS))
    return drift


def reference_key(
    reference: TrialSpec,
    device: torch.device,
    steps: int,
    settings: dict[str, Any] | None = None,
) -> str:
    """What the reference trajectory depends on, hashed: its cache key. The reference spec's
    model, data, optimizer (lr, lr scaling, weight decay, ...: every field), loss and seed, the
    global batch its fixed batches hold, the guard's K steps, the device type, and the
    process-wide settings it trains under (`settings`: gpuopt.engines._guard.reference_settings,
    the thread count it trains with). Nothing else reaches the reference: `reference_spec` fixes
    its precision, compile, kernels, layout and batching, and the guard's tolerance only reads
    it."""
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
    """The sweep dir's `.numerics` folder inside a Hydra multirun, else None (process cache only).
    In a rank of a distributed trial (no Hydra there): the one its trial handed down."""
    if _rank_cache_dir is not None:
        return _rank_cache_dir
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


def inherit_cache_dir(folder: str | None) -> None:
    """A rank's cache folder: its trial's `sweep_cache_dir` (gpuopt.trial.distributed.rank_main)."""
    global _rank_cache_dir
    _rank_cache_dir = Path(folder) if folder else None


def cached_reference(key: str, cache_dir: Path | None) -> list[float] | None:
    """The reference trajectory under `key`: from this process's cache or the sweep dir's, else
    None (to be trained, then `store_reference`)."""
    if key in _reference_cache:
        return _reference_cache[key]
    path = cache_dir / f"{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            _reference_cache[key] = list(json.loads(path.read_text())["losses"])
            return _reference_cache[key]
        except (OSError, ValueError, KeyError):
            pass  # a half-written or foreign file: recompute
    return None


def store_reference(key: str, losses: list[float], cache_dir: Path | None) -> None:
    """Keep a trained reference trajectory for this process and, in a multirun, the sweep."""
    _reference_cache[key] = losses
    if cache_dir is not None:
        _write_atomically(cache_dir / f"{key}.json", {"losses": losses})


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


def evidence(
    spec: TrialSpec,
    losses: list[float],
    reference: list[float],
    skipped_steps: int,
    changes: list[str] | None = None,
    trial_global_batch: int | None = None,
) -> GuardEvidence:
    """The guard's verdict on the trial's trajectory against the reference's (`spec`: what the
    guard trained, `guarded_spec`; `trial_global_batch`: the trial's own, where it differs)."""
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
    """The evidence on the trial: `numerics` (the sweeper's user attr) and `loss_drift`, and a
    warning when it is over the tolerance."""
    trial.metrics.loss_drift = found.loss_drift
    trial.numerics = {**asdict(found), "summary": found.summary}
    if not found.passed:
        trial.warnings.append(f"numerics: {found.summary}")


def record_not_run(trial: Trial, exc: Exception, changes: list[str] | None = None) -> None:
    """Why the guard did not run, as a warning (the guard never turns a measured trial into an
    error) and as the trial's evidence: `passed` None, so that a trial whose math changed
    unchecked is never called the same training (gpuopt.study.rules.same_training). An
    unexpected failure is also logged with its traceback."""
    if not isinstance(exc, NotGuarded) and not is_oom(exc):
        log.warning("numerics guard failed", exc_info=exc)
    why = f"{type(exc).__name__}: {exc}"
    trial.warnings.append(f"numerics guard not run: {why}")
    trial.numerics = _unchecked(why, changes or [])


def _unchecked(why: str, changes: list[str]) -> dict[str, Any]:
    """The evidence of a math change the guard did not check (gpuopt.study.rules reads it)."""
    return {"passed": None, "not_run": why, "changes": list(changes)}
