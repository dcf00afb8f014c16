"""The numerics guard's training side: K optimizer steps of gpuopt's own step on fixed batches,
the trial's way and the fp32 reference way (what the guard decides is gpuopt.trial.numerics).
Both train with gpuopt's step, also for a Lightning trial: the guard compares the math of a
configuration, not the engine's loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuopt.core.spec import TrialSpec
from gpuopt.engines._build import instantiate_data, instantiate_model
from gpuopt.engines._distributed import Ranks
from gpuopt.engines._step import build_workload
from gpuopt.trial import numerics
from gpuopt.trial.numerics import GuardEvidence, NotGuarded

if TYPE_CHECKING:
    import torch

    from gpuopt.trial.context import Trial

Clock = Callable[[str], AbstractContextManager[None]]  # `Trial.phase`


def _unclocked(name: str) -> AbstractContextManager[None]:
    return nullcontext()  # the guard called outside a trial


def guard_numerics(trial: Trial) -> None:
    """The guard on a measured trial (`trial.after_release`), when it is on and the trial changes
    the math; a guard that cannot run leaves a warning. In a distributed trial every rank runs it
    (their trajectory is the job's), rank 0 records it."""
    ranks = Ranks.current(trial.spec, trial.device)
    planned: list[str] = []  # what the trial changes in the math, for a guard that cannot run
    try:
        planned = numerics.math_changes(trial.spec) if trial.spec.guard.enabled else []
        changes = numerics.changes_to_guard(trial.spec)
        if not changes:
            return
        cache = numerics.sweep_cache_dir()
        if ranks is None:
            found = check(trial.spec, trial.device, changes, cache, trial.phase)
        else:
            found = check_ranks(trial.spec, trial.device, ranks, changes, cache, trial.phase)
    except Exception as exc:  # the guard must not turn a measured trial into an error
        if ranks is None or ranks.leader:
            numerics.record_not_run(trial, exc, planned)
        return
    if found is not None:
        numerics.record_evidence(trial, found)


def check(
    spec: TrialSpec,
    device: torch.device,
    changes: list[str] | None = None,
    cache_dir: Path | None = None,
    clock: Clock | None = None,
) -> GuardEvidence:
    """Train K steps `spec`'s way and the fp32 reference way, at the guard's global batch; compare
    the loss trajectories. The reference runs first, so the process's matmul precision ends as the
    trial's."""
    phase = clock or _unclocked
    guarded = numerics.guarded_spec(spec)
    with phase("guard"):
        check_guardable(guarded)
        batches = fixed_batches(guarded, guarded.guard.steps)
    with phase("guard_reference"):
        reference = reference_losses(guarded, device, batches, cache_dir)
    with phase("guard"), guard_threads():
        losses, skipped = loss_trajectory(guarded, device, batches)
        apart = spec.global_batch if guarded is not spec else None
        return numerics.evidence(guarded, losses, reference, skipped, changes, apart)


def check_ranks(
    spec: TrialSpec,
    device: torch.device,
    ranks: Ranks,
    changes: list[str],
    cache_dir: Path | None = None,
    clock: Clock | None = None,
) -> GuardEvidence | None:
    """The distributed trajectory (every rank trains on its share of the same K global batches,
    the losses averaged) against the single-process fp32 reference, which rank 0 trains alone
    afterwards (no rank waits on it); the evidence on rank 0, None elsewhere."""
    phase = clock or _unclocked
    with phase("guard"):
        check_guardable(spec)  # every rank alike: none reaches a collective the others skip
        batches = fixed_batches(spec, spec.guard.steps)
        _check_pairs(batches)
        share = [rank_share(batch, ranks.rank, ranks.world) for batch in batches]
        losses, skipped = loss_trajectory(spec, device, share, ranks)
        averaged = ranks.mean(losses)
    if not ranks.leader:
        return None
    with phase("guard_reference"):
        reference = reference_losses(spec, device, batches, cache_dir)
    return numerics.evidence(spec, averaged, reference, skipped, changes)


def rank_share(batch: Any, rank: int, world: int) -> tuple[Any, Any]:
    """Rank `rank`'s contiguous 1/world of an (inputs, targets) global batch."""
    inputs, targets = batch
    size = len(inputs) // world
    return inputs[rank * size : (rank + 1) * size], targets[rank * size : (rank + 1) * size]


def _check_pairs(batches: list[Any]) -> None:
    if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
        kind = type(batches[0]).__name__ if batches else "no"
        raise NotGuarded(f"the guard splits (inputs, targets) batches into micro-batches: {kind}")


def reference_losses(
    spec: TrialSpec, device: torch.device, batches: list[Any], cache_dir: Path | None
) -> list[float]:
    """The fp32 reference trajectory: from this process's cache, the sweep dir's, or trained now,
    keyed with the process-wide settings it trains under."""
    import torch

    reference = numerics.reference_spec(spec)
    with guard_threads() as threads:
        # What changes the reference's last bits: the thread count and, on CUDA, cuDNN
        # autotuning (the float32 matmul precision the reference sets itself).
        settings: dict[str, Any] = {"threads": threads}
        if torch.cuda.is_available():
            settings["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
        key = numerics.reference_key(reference, device, len(batches), settings=settings)
        cached = numerics.cached_reference(key, cache_dir)
        if cached is not None:
            return cached
        losses, _ = loss_trajectory(reference, device, batches)
    numerics.store_reference(key, losses, cache_dir)
    return losses


@contextmanager
def guard_threads() -> Iterator[int]:
    """The guard's trajectories train on every usable CPU, whatever `device.num_threads` the trial
    set (restored after). The thread count changes only the last bits (how CPU kernels split
    their sums), and one reference then serves all the trials of a global batch, where keying it
    by each trial's count trained it again for every count (seconds a step for a cnn)."""
    import torch

    from gpuopt.core.host import usable_cpus

    before = torch.get_num_threads()
    torch.set_num_threads(usable_cpus())
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def check_guardable(spec: TrialSpec) -> None:
    """NotGuarded, before anything is trained, for a model class with its own `training_step` (a
    LightningModule may bring its own train_dataloader and no `data`)."""
    from hydra.utils import get_object

    target = get_object(spec.model["_target_"])
    if isinstance(target, type) and hasattr(target, "training_step"):
        raise NotGuarded(
            f"{target.__name__} trains through its own training_step "
            "(the guard trains gpuopt's step on data._target_'s samples)"
        )


def fixed_batches(spec: TrialSpec, steps: int) -> list[Any]:
    """K global batches of the dataset's first samples, in order (CPU tensors); NotGuarded without
    a map-style Dataset with samples."""
    from torch.utils.data import default_collate

    target = spec.data.get("_target_")
    if not target:
        raise NotGuarded("no data._target_ to draw its fixed batches from")
    dataset = instantiate_data(spec)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) or not len(dataset):
        kind = "an empty Dataset" if hasattr(dataset, "__len__") else f"a {type(dataset).__name__}"
        raise NotGuarded(
            f"data._target_={target} is {kind}, not a map-style Dataset to draw its fixed "
            "batches from"
        )
    size, batch = len(dataset), spec.global_batch
    return [
        default_collate([dataset[(step * batch + i) % size] for i in range(batch)])
        for step in range(steps)
    ]


def loss_trajectory(
    spec: TrialSpec, device: torch.device, batches: list[Any], ranks: Ranks | None = None
) -> tuple[list[float], int]:
    """(the loss of each of the K optimizer steps, fp16 steps skipped) training `spec`'s way from
    the seeded initial weights; under `ranks` the model wrapped as the trial wraps it."""
    import torch

    from gpuopt.trial import policies

    torch.manual_seed(spec.seed)
    model = instantiate_model(spec)
    if hasattr(model, "training_step"):  # a LightningModule: its own step, not gpuopt's
        raise NotGuarded(f"{type(model).__name__} trains through its own training_step")
    precision = policies.precision_policy(spec.precision, device)
    _check_pairs(batches)
    workload = build_workload(spec, model, device, precision, non_blocking=False, ranks=ranks)
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
