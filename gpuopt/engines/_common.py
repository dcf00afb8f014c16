"""What every training engine shares: building the workload, the trial's lifecycle and failure
classification, the monitors beside the timed window, the compute ceiling, and the window's metrics.

Engines (`gpuopt.engines.native`, `gpuopt.engines.lightning.engine`) import from here and never from each
other; `gpuopt.engines.run_trial` finds them by name. torch is imported inside functions only: the
engine registry (and config validation in the sweeping process) must stay light.

Workload contract (what a user's own model and dataset must follow):

- The dataset (`data._target_`, a `torch.utils.data.Dataset`) yields samples of any structure the
  DataLoader's default collate stacks: `(inputs, targets)` pairs, longer tuples, dicts (Hugging
  Face style: `input_ids`/`attention_mask`/`labels`, `pixel_values`/`labels`), nested containers.
  Batches move to the device recursively (`move_batch`); a batch's sample count is the batch
  dimension of its first tensor (`batch_samples`).
- The model (`model._target_`, an `nn.Module`) is called by the batch's structure (`model_loss`):
  `model(**batch)` for a dict, `model(*batch[:-1])` for a tuple (the last element: the targets).
  Keys of the model config listed in `gpuopt.core.spec.MODEL_META_KEYS` (input, input_shape,
  num_classes, channels_last) describe the model to gpuopt and are not passed to the constructor;
  every other key is a constructor argument.
- The loss (`loss`) is `cross_entropy(outputs.reshape(-1, C), targets.reshape(-1))` with C the last
  dimension of `outputs` (or of `outputs.logits`; classification or next-token prediction; targets
  are int64 class ids), `mse(outputs, targets)` (targets of the outputs' shape), `model` (the
  model gets the whole batch and returns its loss as `outputs.loss` / `outputs["loss"]`, the
  Hugging Face convention, which a dict batch also follows by default), or the user's function by
  `_target_` (`loss: {_target_: mypkg.losses.focal}`), called as `loss(outputs, targets)`.
- User modules must be trusted: `trust=[mypkg.*]` (Hydra's execution whitelist).

Failures become results: out-of-memory -> oom, NaN/inf loss -> diverged, anything else -> error with
the exception's type and message.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuopt.core import limits
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.core.spec import DATA_GPUOPT_KEYS, MODEL_META_KEYS, TrialSpec
from gpuopt.trial.measure import (
    StepFlops,
    WindowResult,
    amortized_throughput,
    epoch_overhead,
    mfu_percent,
    peak_flops,
    relative_ci_halfwidth,
    step_stats,
    synchronize,
)

if TYPE_CHECKING:
    import torch

    from gpuopt.core.spec import EngineConf, LoaderConf, MeasureConf
    from gpuopt.trial.knobs import CachePolicy, PrecisionPolicy

log = logging.getLogger(__name__)

# Compute-ceiling steps run (unmeasured) before timing it: the model is already warm, this only
# re-warms caches for the replayed batch.
CEILING_WARMUP_STEPS = 1
# The ceiling replay stops after this share of measure.time_budget_s (or measure.ceiling_steps).
CEILING_BUDGET_SHARE = 0.25
# ... but not before this many timed replay steps.
CEILING_MIN_STEPS = 3
# Batches beyond the trial's own needs in its one long epoch (a guard for off-by-one consumers).
EPOCH_MARGIN_STEPS = 2
# The worker-like loop that prices the input pipeline runs this long (at least one batch).
LOADER_COST_BUDGET_S = 0.2


# -- the trial's lifecycle ------------------------------------------------------------------------
@dataclass
class Trial:
    """Everything a trial holds, so failures can release it and partial metrics survive."""

    spec: TrialSpec
    device: torch.device
    metrics: Metrics = field(default_factory=Metrics)
    warnings: list[str] = field(default_factory=list)
    inspect: Callable[[str, Any], None] | None = None
    # What the engine built and must let go of at the trial's end (closed first where it has a
    # close()), so the device cache can be given back even after a failure.
    resources: list[Any] = field(default_factory=list)
    profile: dict[str, Any] | None = None  # the profiled window's summary (gpuopt.trial.profile)

    def show(self, name: str, obj: Any) -> None:
        """Hand a built object to the `inspect` hook of run_trial (tests, debugging)."""
        if self.inspect is not None:
            self.inspect(name, obj)


# An engine: fills `trial.metrics` (and warnings), raising on failure; `process_t0` is when
# startup_time_s counts from.
Measure = Callable[[Trial, float], None]

# Trials run so far in this process: startup_time_s counts from process start only for the first.
_trials_in_process = 0
_MODULE_LOADED_AT = time.time()  # the fallback "earliest timestamp" when /proc is absent


def process_start_time() -> float | None:
    """When this process started (time.time() epoch), from /proc on Linux; None elsewhere.

    Uses the process's age (uptime - starttime, 10 ms resolution) rather than /proc/stat's btime,
    which has only 1 s resolution.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 (starttime); fields[0] is field 3 (state)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _startup_reference() -> tuple[float, bool]:
    """(when startup_time_s counts from, whether an earlier trial ran in this process)."""
    global _trials_in_process
    trial_t0 = time.time()
    earlier = _trials_in_process > 0
    _trials_in_process += 1
    if earlier:
        return trial_t0, True
    return process_start_time() or _MODULE_LOADED_AT, False


def measuring_spec(
    device: torch.device,
    measure: MeasureConf,
    engine: EngineConf,
    precision_mode: str = "fp32",
    compile_mode: str = "off",
    loader: LoaderConf | None = None,
) -> TrialSpec:
    """A TrialSpec for measuring what the user built (gpuopt.measure_step, gpuopt.MeasureCallback):
    the measure settings and what the clocks need to know; the rest default, since gpuopt builds
    nothing (the model, data, optimizer and loop are the user's)."""
    from gpuopt.core import spec as schemas

    return TrialSpec(
        model={},
        data={},
        loader=loader or schemas.LoaderConf(),
        precision=schemas.PrecisionConf(mode=precision_mode),
        compile=schemas.CompileConf(mode=compile_mode),
        cache=schemas.CacheConf(),
        optimizer=schemas.OptimizerConf(),
        device=schemas.DeviceConf(type=str(device)),
        measure=measure,
        loss="model",
        seed=0,
        trusted_targets=(),
        engine=engine,
    )


def spec_to_dict(spec: TrialSpec) -> dict[str, Any]:
    data = dataclasses.asdict(spec)
    data["trusted_targets"] = list(spec.trusted_targets)
    return data


# A window that lost more of the machine's CPU time than this to the hypervisor is flagged.
STEAL_WARN_PCT = 5.0


def run_measured(
    spec: TrialSpec,
    load_engine: Callable[[], Measure],
    device: torch.device | None = None,
    inspect: Callable[[str, Any], None] | None = None,
) -> TrialResult:
    """Build and measure one configuration with the engine `load_engine()` returns (called inside
    the failure handling: an engine that cannot be imported is an error result like any other).
    Never raises for a failing workload: OOM, divergence and errors come back as the status."""
    from gpuopt.env import fingerprint, resolve_device

    process_t0, earlier_trial = _startup_reference()
    device = device if device is not None else resolve_device(spec.device.type)
    trial = Trial(spec, device, inspect=inspect)
    status, reason = Status.OK, None
    try:
        load_engine()(trial, process_t0)
    except Exception as exc:
        status, reason = classify_failure(exc)
    finally:
        release(trial, status)
    if earlier_trial:
        trial.warnings.append(
            "startup_time_s counts from the start of this trial (not process start): "
            "an earlier trial ran in this process"
        )
    if (steal := trial.metrics.cpu_steal_pct) is not None and steal > STEAL_WARN_PCT:
        trial.warnings.append(
            f"the hypervisor gave {steal:.0f}% of this machine's CPU time to other guests during "
            "the timed window (cpu_steal_pct): this trial's numbers read low by up to that much"
        )
    return TrialResult(
        status=status,
        metrics=trial.metrics,
        reason=reason,
        config=spec_to_dict(spec),
        env=fingerprint(device),
        warnings=trial.warnings,
        profile=trial.profile,
    )


def release(trial: Trial, status: Status) -> None:
    """Let go of what the trial built and give the allocator's cache back as the cache policy
    says (always after an OOM). In-process clean-up between trials belongs here."""
    from gpuopt.trial.knobs import CachePolicy, empty_device_cache

    for resource_ in trial.resources:
        close = getattr(resource_, "close", None)
        if callable(close):
            close()
    trial.resources.clear()
    if trial.spec.compile.mode != "off":
        reset_compiler()
    gc.collect()
    CachePolicy(trial.spec.cache, trial.device).at_trial_end()
    if status is Status.OOM:
        # After an OOM the cache holds the failed trial's blocks: always give them back, so the
        # next trial in this process starts from an empty device.
        empty_device_cache(trial.device)


def reset_compiler() -> None:
    """Forget what torch.compile built in this process, so the next in-process trial compiles
    afresh (no cache hit, no recompile-limit carry-over from this trial's guards).
    `torch.compiler.reset()` clears Dynamo's in-memory caches and, where CUDA is available, shuts
    the CUDA-graph trees down (`reset_cudagraph_trees`), releasing their private memory pools to
    the caching allocator (given back to the driver by the cache policy / after an OOM)."""
    import torch

    torch.compiler.reset()


# -- failure classification -----------------------------------------------------------------------
class Diverged(Exception):
    """The loss became NaN or inf."""


# Out-of-memory as the CUDA libraries report it: a workspace or handle they could not allocate
# (e.g. "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
# "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), raised as a RuntimeError / torch.AcceleratorError,
# not as torch.OutOfMemoryError.
LIBRARY_OOM_STATUSES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), the CPU allocator's failure, MPS's out-of-memory error,
    and cuBLAS/cuDNN allocation failures (LIBRARY_OOM_STATUSES)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text
        or "out of memory" in text.lower()
        or any(status in text for status in LIBRARY_OOM_STATUSES)
    )


def classify_failure(exc: Exception) -> tuple[Status, str]:
    """The status and reason of a trial that raised `exc` (errors are also logged with traceback)."""
    if isinstance(exc, Diverged):
        return Status.DIVERGED, str(exc)
    if is_oom(exc):
        status = Status.OOM
    else:
        status = Status.ERROR
        log.warning("trial failed", exc_info=exc)
    return status, f"{type(exc).__name__}: {str(exc).strip()}"


class NonFiniteLoss:
    """A device-side flag: whether any loss so far was NaN/inf. Updated without a host sync (reading
    the loss on the host each step would sync every step); read only at window ends."""

    def __init__(self) -> None:
        self.flag: torch.Tensor | None = None

    def update(self, loss: torch.Tensor | None) -> None:
        import torch

        if loss is None:
            return
        if self.flag is None:
            self.flag = torch.zeros((), dtype=torch.bool, device=loss.device)
        torch.logical_or(self.flag, ~torch.isfinite(loss.detach()), out=self.flag)

    def check(self, phase: str) -> None:
        if self.flag is not None and bool(self.flag):  # a CPU-GPU sync point: window ends only
            raise Diverged(f"loss became NaN/inf during {phase}")


# -- building -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrialPolicies:
    precision: PrecisionPolicy
    cache: CachePolicy


def apply_policies(spec: TrialSpec, device: torch.device) -> TrialPolicies:
    """The process-wide settings (threads, float32 matmul precision / TF32, cuDNN autotuning),
    applied before anything is built."""
    from gpuopt.trial import knobs

    knobs.set_num_threads(spec.device.num_threads)
    precision = knobs.precision_policy(spec.precision, device)
    cache = knobs.CachePolicy(spec.cache, device)
    cache.apply()
    return TrialPolicies(precision, cache)


def instantiate_trusted(config: dict[str, Any], trusted: tuple[str, ...], **kwargs: Any) -> Any:
    from hydra.utils import instantiate

    # Hydra 1.4's execution whitelist: only trusted `_target_`s (also nested ones) may be called.
    return instantiate(config, _execution_whitelist_=list(trusted), _convert_="all", **kwargs)


def instantiate_model(spec: TrialSpec) -> Any:
    """The model config's object, built without gpuopt's descriptive keys (MODEL_META_KEYS)."""
    model_kwargs = {k: v for k, v in spec.model.items() if k not in MODEL_META_KEYS}
    return instantiate_trusted(model_kwargs, spec.trusted_targets)


def instantiate_data(spec: TrialSpec, **kwargs: Any) -> Any:
    """The data config's object (a Dataset, or under Lightning a LightningDataModule), built
    without gpuopt's own data keys (DATA_GPUOPT_KEYS)."""
    data = {k: v for k, v in spec.data.items() if k not in DATA_GPUOPT_KEYS}
    return instantiate_trusted(data, spec.trusted_targets, **kwargs)


def compute_loss(loss_name: str, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The `loss` config: cross_entropy over the last dimension of `outputs`, or mse."""
    import torch.nn.functional as F

    if loss_name == "mse":
        return F.mse_loss(outputs, targets.to(outputs.dtype))
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def build_optimizer(spec: TrialSpec, params: Any) -> torch.optim.Optimizer:
    """The optimizer group's optimizer; its lr scaled by `optimizer.lr_scaling` (spec.lr_scale)."""
    import torch

    conf = spec.optimizer
    kwargs: dict[str, Any] = {"lr": conf.lr * spec.lr_scale, "weight_decay": conf.weight_decay}
    if conf.foreach is not None:
        kwargs["foreach"] = conf.foreach
    if conf.fused is not None:
        kwargs["fused"] = conf.fused
    if conf.name == "sgd":
        return torch.optim.SGD(params, momentum=conf.momentum, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def record_batches(trial: Trial) -> None:
    """What one optimizer step trains on, and the lr factor, into the trial's metrics."""
    m, spec = trial.metrics, trial.spec
    m.global_batch, m.micro_batch = spec.global_batch, spec.micro_batch
    m.accumulation_steps, m.lr_scale = spec.accumulation_steps, spec.lr_scale


def build_loader(spec: TrialSpec, dataset: Any, device: torch.device, warnings: list[str]) -> Any:
    import torch
    from torch.utils.data import DataLoader

    conf = spec.loader
    kwargs: dict[str, Any] = {}
    if conf.num_workers > 0:
        if conf.prefetch_factor is not None:
            kwargs["prefetch_factor"] = conf.prefetch_factor
        kwargs["persistent_workers"] = conf.persistent_workers
    else:
        ignored = [
            name
            for name, value in (
                ("prefetch_factor", conf.prefetch_factor),
                ("persistent_workers", conf.persistent_workers),
            )
            if value
        ]
        if ignored:
            warnings.append(f"loader.{' and loader.'.join(ignored)} ignored: loader.num_workers=0")
    generator = torch.Generator().manual_seed(spec.seed)
    return DataLoader(
        dataset,
        batch_size=conf.batch_size,
        sampler=steady_sampler(spec, dataset, generator),
        generator=generator,
        num_workers=conf.num_workers,
        # Page-locked host buffers: needed for truly asynchronous H2D copies. Without an
        # accelerator PyTorch ignores it (with a warning).
        pin_memory=conf.pin_memory and device.type != "cpu",
        drop_last=conf.drop_last,
        **kwargs,
    )


def trial_samples(spec: TrialSpec) -> int:
    """The most samples a trial draws from its loader before the window ends: the first batch,
    the warm-up, the window's max_steps (and a small margin); a step is an optimizer step of
    `global_batch` samples (accumulation_steps micro-batches)."""
    steps = 1 + spec.measure.warmup_steps + spec.measure.max_steps + EPOCH_MARGIN_STEPS
    return steps * spec.global_batch


def steady_sampler(spec: TrialSpec, dataset: Any, generator: torch.Generator) -> Any:
    """A shuffling sampler whose one epoch lasts the whole trial: the dataset's own random order,
    and where the dataset is shorter than the trial, further random passes over it inside the
    same epoch (`RandomSampler(num_samples=...)`, one fresh permutation per pass, drawn lazily).
    So the loader never restarts (no worker respawn, no refill) inside the timed window; what an
    epoch boundary costs is measured apart (`measure_epoch_boundary`). None for a dataset without
    a length (an IterableDataset: no sampler, no epochs)."""
    from torch.utils.data import RandomSampler

    length = dataset_length(dataset)
    if length is None:
        return None
    return RandomSampler(dataset, num_samples=max(length, trial_samples(spec)), generator=generator)


def dataset_length(dataset: Any) -> int | None:
    """len(dataset) for a map-style dataset, None for an IterableDataset or one without len."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        return None
    try:
        return len(dataset)
    except TypeError:
        return None


# -- batches of any structure ---------------------------------------------------------------------
def move_batch(
    batch: Any,
    device: torch.device,
    non_blocking: bool = False,
    pin_memory: bool = False,
    channels_last: bool = False,
) -> Any:
    """`batch` on `device`, its structure kept: tensors in (nested) tuples, lists, namedtuples,
    dicts and Mappings (a Hugging Face BatchEncoding too) are copied; anything else (strings,
    numbers) passes through. `pin_memory` page-locks host tensors first (what a DataLoader with
    pin_memory=True already did), so that `non_blocking` copies are truly asynchronous; it is a no-op
    off CUDA. `channels_last` formats 4-D float tensors (images) NHWC."""
    import torch

    pin = pin_memory and device.type == "cuda"

    def move(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            if pin and item.device.type == "cpu" and not item.is_pinned():
                item = item.pin_memory()
            item = item.to(device, non_blocking=non_blocking)
            if channels_last and item.dim() == 4 and item.is_floating_point():
                item = item.contiguous(memory_format=torch.channels_last)
            return item
        if isinstance(item, Mapping):
            moved = {key: move(value) for key, value in item.items()}
            return moved if type(item) is dict else _rebuild_mapping(item, moved)
        if isinstance(item, tuple) and hasattr(item, "_fields"):  # a namedtuple
            return type(item)(*(move(value) for value in item))
        if isinstance(item, (tuple, list)):
            return type(item)(move(value) for value in item)
        return item

    return move(batch)


def _rebuild_mapping(original: Mapping[str, Any], moved: dict[str, Any]) -> Mapping[str, Any]:
    """A Mapping of the original's type holding `moved` (a plain dict when it cannot be rebuilt)."""
    try:
        return type(original)(moved)  # type: ignore[call-arg]
    except Exception:
        return moved


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor of a (nested) batch, depth first in order, or None."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (Mapping, tuple, list)):
        for value in batch.values() if isinstance(batch, Mapping) else batch:
            found = first_tensor(value)
            if found is not None:
                return found
    return None


SampleCount = int | Callable[[Any], int] | None


def batch_samples(batch: Any, samples: SampleCount = None) -> int:
    """How many samples `batch` holds: `samples` (a count, or a function of the batch) when given,
    else the batch dimension (dim 0) of its first tensor. Raises TypeError without a tensor."""
    if callable(samples):
        return int(samples(batch))
    if samples is not None:
        return int(samples)
    tensor = first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        raise TypeError(
            f"cannot tell the sample count of a {type(batch).__name__} batch (no tensor with a "
            "batch dimension): give samples_per_batch"
        )
    return int(tensor.shape[0])


def outputs_loss(outputs: Any) -> torch.Tensor | None:
    """The loss a model returned, the Hugging Face way: `outputs.loss` or `outputs["loss"]`."""
    import torch

    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def outputs_logits(outputs: Any) -> Any:
    """The tensor a loss compares with targets: the outputs, or their `logits` (HF)."""
    import torch

    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
    return logits if logits is not None else getattr(outputs, "logits", outputs)


LossFunction = Callable[[Any, Any], "torch.Tensor"]


def build_loss(spec: TrialSpec) -> str | LossFunction:
    """The `loss` config: a built-in name (cross_entropy | mse | model), or the user's loss function
    built from its `_target_` (a function, or a class such as torch.nn.CrossEntropyLoss, whose
    instance is the function), called as `loss(outputs, targets)`."""
    from hydra.utils import get_object

    if isinstance(spec.loss, str):
        return spec.loss
    # A class is instantiated (its instance is the function); a function is bound, not called.
    is_function = not isinstance(get_object(spec.loss["_target_"]), type)
    built = instantiate_trusted(dict(spec.loss), spec.trusted_targets, _partial_=is_function)
    if not callable(built):
        raise TypeError(f"loss._target_={spec.loss['_target_']} built a non-callable")
    return built


def model_loss(forward: Callable[..., Any], batch: Any, loss: str | LossFunction) -> torch.Tensor:
    """One forward pass and its loss under the model contract (gpuopt.engines._common docstring):

    - a dict batch (Hugging Face style): `model(**batch)`; the loss is the outputs' own `loss`
      unless `loss` is a user function (then `loss(outputs, batch)`);
    - `loss: model` with a tuple/list batch: `model(*batch)`, the outputs' own `loss`;
    - a tuple/list batch: `model(*batch[:-1])`, targets `batch[-1]`, then `loss(outputs, targets)`
      or the built-in cross_entropy/mse on the outputs (or their `logits`);
    - a single tensor: `model(batch)`, which must return its loss (or a user function of it).
    """
    if isinstance(batch, Mapping):
        outputs, targets = forward(**batch), batch
    elif isinstance(batch, (tuple, list)) and loss == "model":
        outputs, targets = forward(*batch), None
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        outputs, targets = forward(*batch[:-1]), batch[-1]
    else:
        outputs, targets = forward(batch), None
    if callable(loss):
        return loss(outputs, targets)
    own = outputs_loss(outputs)
    if own is not None and (targets is None or targets is batch or loss == "model"):
        return own
    if targets is None or targets is batch:
        raise TypeError(
            f"the model returned no loss for a {type(batch).__name__} batch: return one as "
            "outputs.loss / outputs['loss'] (the Hugging Face convention), or set loss._target_ "
            "to a function loss(outputs, targets)"
        )
    return compute_loss(loss, outputs_logits(outputs), targets)


class BatchFeed:
    """Endless batches from `loader` (any re-iterable: a DataLoader, a list; restarted at each epoch
    end), each moved by `move` (onto the device), with what waiting for them cost (`wait`) and how
    many samples they held (`samples`), both reset at the window's start."""

    def __init__(
        self,
        loader: Any,
        move: Callable[[Any], Any],
        device: torch.device,
        samples: SampleCount = None,
        accumulation_steps: int = 1,
    ) -> None:
        self.loader, self.move, self.sample_count = loader, move, samples
        self.accumulation_steps = accumulation_steps
        self.iterator: Any = None
        self.batches = self.samples = 0
        # On CUDA the starvation is read on the GPU timeline (events), whatever the copy mode.
        self.wait = InputWait(device)

    def reset_counters(self) -> None:
        self.batches = self.samples = 0
        self.wait.reset()

    def _fetch(self) -> Any:
        if self.iterator is None:
            self.iterator = iter(self.loader)
        try:
            return next(self.iterator)
        except StopIteration:  # epoch end: a new iterator (new workers unless persistent_workers)
            self.iterator = iter(self.loader)
        try:
            return next(self.iterator)
        except StopIteration:
            raise RuntimeError(
                f"the batches ran out after {self.batches} in the window: give a re-iterable "
                "(a DataLoader, a list), not a one-shot iterator, or more batches"
            ) from None

    def next(self) -> Any:
        self.wait.fetch_started()
        batch = self._fetch()
        self.wait.fetch_ended()
        self.batches += 1
        self.samples += batch_samples(batch, self.sample_count)
        self.wait.copy_started()
        batch = self.move(batch)
        self.wait.copy_ended()
        return batch

    def next_step(self) -> list[Any]:
        """The micro-batches of one optimizer step (`accumulation_steps` of them)."""
        return [self.next() for _ in range(self.accumulation_steps)]

    def close(self) -> None:
        """Stop the worker processes (they would compete with the ceiling measurement)."""
        iterator, self.iterator = self.iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def measure_timed_window(
    trial: Trial,
    run_step: Callable[[], Any],
    feed: BatchFeed,
    memory: MemoryBaseline,
    precision_mode: str | None,
    process_t0: float,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """The timed window of a loop engine: `run_step()` (one optimizer step over batches it takes
    from `feed`) until `gpuopt.trial.measure.StopRule` says stop, with the monitors on and the memory
    peaks reset, then the window's metrics (`record_window`, over the samples `feed` gave)."""
    from gpuopt.trial.measure import StopRule, make_clock, run_window

    measure, device = trial.spec.measure, trial.device
    monitors = WindowMonitors(device, measure.nvml_interval_s, trial.warnings)

    def step(index: int) -> None:
        run_step()
        if after_step is not None:
            after_step(index)

    feed.reset_counters()
    memory.window_starting()
    monitors.start()
    try:
        window = run_window(step, make_clock(device), StopRule.from_measure(measure))
    finally:
        nvml = monitors.stop()
    # clock.finish() synchronized: the window's work (and copies) has completed.
    record_window(
        trial.metrics,
        window,
        feed.samples,
        feed.wait.totals(),
        device,
        nvml,
        memory,
        precision_mode,
        process_t0,
    )


# -- memory ---------------------------------------------------------------------------------------
def peak_rss_mb() -> float:
    """The process's peak resident set size so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


@dataclass(frozen=True)
class MemoryBaseline:
    """Where the window's memory metrics count from.

    CUDA: the allocator's peak statistics are reset by `window_starting` (after warm-up, just
    before the timed window), so `peak_mb` / `peak_reserved_mb` are the steady state's peaks, not
    the eager FLOP-count step's activations, compilation or cudnn.benchmark's trial workspaces.
    After a reset a peak starts at what is in use then: `release_cache` (before the warm-up steps)
    gives the blocks those one-off steps left cached back to the driver, so the reserved peak is
    what the warm-up and the window re-reserve (expandable_segments and compile show there).
    CPU: ru_maxrss is the process's high-water mark and cannot be reset: the peak RSS's growth
    from `take` (before the trial builds anything)."""

    device: torch.device
    rss_before_mb: float

    @classmethod
    def take(cls, device: torch.device) -> MemoryBaseline:
        return cls(device, peak_rss_mb())

    def release_cache(self) -> None:
        """Give cached, unused device blocks back (outside the window: before the warm-up steps)."""
        from gpuopt.trial.knobs import empty_device_cache

        empty_device_cache(self.device)

    def window_starting(self) -> None:
        """Reset the device's peak statistics: the peaks read afterwards are the window's."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_mb(self) -> float | None:
        """CUDA: the allocator's peak of allocated memory since `window_starting`; CPU: the peak
        RSS's growth since `take`; else None."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.device.type == "cpu":
            return max(0.0, peak_rss_mb() - self.rss_before_mb)
        return None

    def peak_reserved_mb(self) -> float | None:
        """CUDA: the caching allocator's peak of reserved (allocated + cached) memory since
        `window_starting`, what the device must hold; None elsewhere."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_reserved(self.device) / 2**20
        return None


# -- FLOP counts ----------------------------------------------------------------------------------
def attention_tf32_note(
    peak_mode: str | None, capability: tuple[int, int] | None, flops: StepFlops
) -> str | None:
    """A note for fp32 MFU of a model with attention on sm80+: PyTorch's memory-efficient attention
    (the SDPA kernel fp32 gets; flash and cuDNN attention take fp16/bf16 only) runs its matmuls on
    tensor cores for fp32 there, whatever allow_tf32 says, while mfu is against the non-tensor-core
    fp32 peak."""
    if peak_mode != "fp32" or capability is None or capability < (8, 0) or not flops.attention:
        return None
    share = 100.0 * flops.attention / flops.hardware if flops.hardware else 0.0
    return (
        f"precision fp32 with attention ({share:.0f}% of the counted FLOPs): PyTorch's "
        "memory-efficient attention uses tensor cores for fp32 on sm80+ regardless of allow_tf32, "
        "so mfu (against the fp32 non-tensor-core peak) overstates the fp32 math's share"
    )


def flop_notes(
    spec: TrialSpec, device: torch.device, peak_mode: str | None, flops: StepFlops
) -> list[str]:
    """What a trial's MFU must be read with: tensor-core attention under fp32 (CUDA sm80+).
    (Activation checkpointing needs no note: `mfu` counts model FLOPs, `hfu` hardware FLOPs.)"""
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    attention = attention_tf32_note(peak_mode, capability, flops)
    return [attention] if attention else []


# -- beside the timed window ----------------------------------------------------------------------
class WindowMonitors:
    """The NVML sampler running beside the timed window (none where NVML is absent: a note says
    why). `stop` may be called more than once (the window's end, then a failure's clean-up)."""

    def __init__(self, device: torch.device, interval_s: float, notes: list[str]) -> None:
        self.device, self.interval_s, self.notes = device, interval_s, notes
        self._sampler: Any = None

    def start(self) -> None:
        from gpuopt.trial import monitor

        sampler, note = monitor.open_sampler(self.device, self.interval_s)
        if note:
            self.notes.append(note)
        self._sampler = sampler
        if sampler is not None:
            sampler.start()

    def stop(self) -> Any:
        """The window's NVML statistics (`gpuopt.trial.monitor.NvmlStats`), or None without a sampler.
        The statistics' `notes` (a number that fell back to NVML's coarser averages) join the
        trial's notes."""
        sampler, self._sampler = self._sampler, None
        stats = sampler.stop() if sampler is not None else None
        for note in getattr(stats, "notes", ()) or ():
            if note not in self.notes:
                self.notes.append(note)
        return stats


@dataclass(frozen=True)
class InputWaitSeconds:
    """What the input pipeline cost the timed window, in seconds."""

    device_s: float  # the device starved of input (CUDA: on the GPU timeline; else = host_s)
    host_s: float  # the host blocked in next(loader)


def _cuda_event_recorder(device: torch.device) -> Callable[[], Any]:
    """A function recording a timing event on `device`'s current stream (asynchronous)."""
    import torch

    def record() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    return record


class InputWait:
    """What the input pipeline costs the loop inside the timed window. Each engine marks the fetch
    (`next(loader)`) and host-to-device copy spans of its own loop; `totals` gives

    - `host_s`: host time blocked fetching (the loader's time, on every device);
    - `device_s`: time the device sat starved of input. On CUDA it is read on the GPU timeline:
      per step, an event recorded on the stream when the fetch starts (reached once the previous
      step's queued work is done) to one after the copy (reached once the batch is on the device):
      the stream's idle gap waiting for the host's fetch, plus the copy itself. Loader time that
      overlaps queued compute costs nothing there, whatever syncs the step makes (fp16's
      GradScaler) and however the engine copies (blocking or not). Without CUDA events (CPU,
      MPS) it is the host's fetch time, the same thing on a synchronous device.

    `record_event` (tests: a stand-in) records a timing event on the device's stream."""

    def __init__(
        self,
        device: torch.device,
        record_event: Callable[[], Any] | None = None,
        host_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if record_event is None and device.type == "cuda":
            record_event = _cuda_event_recorder(device)
        self._record_event = record_event
        self._host_clock = host_clock
        self.fetch_s = 0.0
        self._fetch_t0: float | None = None
        self._spans: list[tuple[Any, Any]] = []  # (fetch started, copy ended) events
        self._span_start: Any = None

    def reset(self) -> None:
        self.fetch_s, self._fetch_t0, self._spans, self._span_start = 0.0, None, [], None

    def _open_span(self) -> None:
        if self._record_event is not None and self._span_start is None:
            self._span_start = self._record_event()

    def fetch_started(self) -> None:
        self._fetch_t0 = self._host_clock()
        self._open_span()

    def fetch_ended(self) -> None:
        if self._fetch_t0 is not None:
            self.fetch_s += self._host_clock() - self._fetch_t0
            self._fetch_t0 = None

    def copy_started(self) -> None:
        self._open_span()  # a step whose batch was fetched earlier (prefetched) starts here

    def copy_ended(self) -> None:
        if self._span_start is not None:
            self._spans.append((self._span_start, self._record_event()))  # type: ignore[misc]
            self._span_start = None

    def totals(self) -> InputWaitSeconds:
        """The window's totals since the reset (call after the window's closing synchronize: an
        event's elapsed time is defined once both were reached)."""
        if self._record_event is None:
            return InputWaitSeconds(device_s=self.fetch_s, host_s=self.fetch_s)
        device_ms = sum(start.elapsed_time(end) for start, end in self._spans)
        return InputWaitSeconds(device_s=device_ms / 1e3, host_s=self.fetch_s)


# -- the compute ceiling --------------------------------------------------------------------------
class CeilingReplay:
    """The compute ceiling: the trial's first batch, already on the device, replayed with no loader
    (CEILING_WARMUP_STEPS untimed steps, then up to `max_steps` timed ones, ended early once
    `budget_s` passed after CEILING_MIN_STEPS: a slow step must not make the ceiling cost more
    than the window itself). Synchronized at both ends; the budget is read on the host, so on CUDA
    the queue may run a little past it, and the final synchronize counts that in.

    Engines drive it: a loop calls `run(step)`; a framework's batch-end hook calls `begin()` once
    and `step_done(samples)` after each replayed step, stopping when it returns True."""

    def __init__(
        self,
        device: torch.device,
        max_steps: int,
        budget_s: float,
        warmup_steps: int = CEILING_WARMUP_STEPS,
        min_steps: int = CEILING_MIN_STEPS,
    ) -> None:
        self.device, self.max_steps, self.budget_s = device, max_steps, budget_s
        self.warmup_steps, self.min_steps = warmup_steps, min_steps
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

    @property
    def max_batches(self) -> int:
        """The most batches the replay can take (warm-up included)."""
        return self.warmup_steps + self.max_steps

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
            self.steps >= self.min_steps and time.perf_counter() - self._t0 >= self.budget_s
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

    @property
    def compute_cost_s(self) -> float | None:
        """Core-seconds of CPU per replayed sample (None before a replay ended)."""
        if self.cpu_seconds is None:
            return None
        return limits.per_sample_cost(self.cpu_seconds, self.samples)


# -- steady state: the epoch boundary, measured apart ---------------------------------------------
@dataclass(frozen=True)
class EpochBoundary:
    """What an epoch boundary costs, measured after the window (`measure_epoch_boundary`):
    `first_fetch_s` from a fresh epoch's iter() to its first batch, `steady_fetch_s` the window's
    mean host fetch wait per step, `epoch_steps` the user's real steps per epoch (None: unknown,
    an endless stream)."""

    first_fetch_s: float | None
    steady_fetch_s: float
    epoch_steps: int | None


def real_epoch_steps(spec: TrialSpec, dataset_len: int | None) -> int | None:
    """The user's steps per epoch: `data.epoch_steps`, else the dataset's length / batch size."""
    explicit = spec.data.get("epoch_steps")
    if explicit:
        return int(explicit)
    if not dataset_len:
        return None
    batch = spec.loader.batch_size
    steps = dataset_len // batch if spec.loader.drop_last else -(-dataset_len // batch)
    return max(1, steps)


def time_epoch_start(loader: Any) -> float:
    """Host seconds from a fresh epoch's `iter(loader)` to its first batch: new worker processes
    (or, with persistent_workers, the same ones resumed), the sampler's new order, the first batch
    made from scratch. The epoch's workers are stopped after it unless they persist."""
    persistent = bool(getattr(loader, "persistent_workers", False))
    if persistent and getattr(loader, "_iterator", None) is None:
        # Between real epochs persistent workers are alive (e.g. Lightning stopped them at the
        # fit's end): start them, untimed, so the timed boundary resumes them.
        next(iter(loader))
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    seconds = time.perf_counter() - started
    if not persistent:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    return seconds


def measure_epoch_boundary(
    spec: TrialSpec, loader: Any, fetch_wait_s: float, steps: int
) -> EpochBoundary:
    """The epoch boundary's cost for `loader` (the trial's DataLoader, its window over; the
    caller stopped its non-persistent workers first). Outside any timed span."""
    first_fetch = time_epoch_start(loader) if hasattr(loader, "__iter__") else None
    length = dataset_length(getattr(loader, "dataset", None))
    return EpochBoundary(first_fetch, fetch_wait_s / max(1, steps), real_epoch_steps(spec, length))


def record_steady_state(m: Metrics, boundary: EpochBoundary) -> None:
    """epoch_overhead_s, epoch_steps and throughput_amortized (over the user's epoch length)."""
    if m.throughput is None or not m.timed_steps or not m.timed_seconds:
        return
    if boundary.first_fetch_s is not None:
        m.epoch_overhead_s = epoch_overhead(boundary.first_fetch_s, boundary.steady_fetch_s)
    m.epoch_steps = boundary.epoch_steps
    m.throughput_amortized = amortized_throughput(
        m.throughput, m.timed_seconds / m.timed_steps, boundary.epoch_steps, m.epoch_overhead_s
    )


# -- the machine's limit for this workload (gpuopt.core.limits) ----------------------------------------
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
    """Core-seconds per sample of the input pipeline, in a worker-like loop outside the window:
    one DataLoader worker process (one torch thread, the worker's seeding, `get_worker_info()`
    set) prices a batch loop (`_PricedLoop`) on its thread's CPU clock, so other jobs on the cores
    do not inflate the cost. None without a map-style dataset."""
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


def record_limit(
    m: Metrics, device: torch.device, loader_cost_s: float | None, ceiling: CeilingReplay | None
) -> None:
    """loader/compute cost per sample, limit_throughput (what bounds it) and limit_efficiency."""
    from gpuopt.env import usable_cpus

    compute_cost = ceiling.compute_cost_s if ceiling is not None else None
    m.loader_cost_us = None if loader_cost_s is None else loader_cost_s * 1e6
    m.compute_cost_us = None if compute_cost is None else compute_cost * 1e6
    limit = limits.machine_limit(
        device.type, usable_cpus(), loader_cost_s, compute_cost, m.ceiling_throughput
    )
    if limit is None:
        return
    m.limit_throughput, m.limit_bound = limit.throughput, limit.bound
    m.limit_efficiency = limits.limit_efficiency(m.throughput, limit.throughput)


def record_achievable_mfu(m: Metrics, device: torch.device, precision_mode: str | None) -> None:
    """mfu_achievable: model FLOP/s against this machine's measured matmul peak for the dtype
    (gpuopt.env's probe, cached per hardware fingerprint; run here, after every timed span)."""
    from gpuopt.env import probed_peak_flops

    if not precision_mode or not m.flops_per_sample or not m.throughput:
        return
    m.peak_flops_measured = probed_peak_flops(device, precision_mode)
    m.mfu_achievable = mfu_percent(m.flops_per_sample, m.throughput, m.peak_flops_measured)


# -- the window's metrics -------------------------------------------------------------------------
def record_window(
    m: Metrics,
    window: WindowResult,
    samples: int,
    input_wait: InputWaitSeconds,
    device: torch.device,
    nvml: Any,
    memory: MemoryBaseline,
    precision_mode: str | None,
    process_t0: float,
) -> None:
    """The timed window's metrics (every engine): throughput, step-time statistics, data wait
    (`input_wait.device_s`: starvation) and host data wait, peak memory, utilization/power/energy
    and MFU. Call after the window's closing synchronize."""
    import torch

    m.timed_steps, m.timed_seconds, m.stop_reason = window.steps, window.wall_s, window.stop_reason
    m.throughput = samples / window.wall_s
    m.startup_time_s = window.first_step_at - process_t0
    stats = step_stats(window.step_times)
    m.step_time_ms, m.step_time_p10_ms, m.step_time_p90_ms = (
        stats.median_ms,
        stats.p10_ms,
        stats.p90_ms,
    )
    m.step_time_cv = stats.cv
    m.throughput_ci = relative_ci_halfwidth(window.step_times)
    m.cpu_steal_pct = window.steal_pct
    m.data_wait = min(100.0, 100.0 * input_wait.device_s / window.wall_s)
    m.host_data_wait = min(100.0, 100.0 * input_wait.host_s / window.wall_s)
    peak_memory = memory.peak_mb()
    if peak_memory is not None:
        m.peak_memory_mb = peak_memory
    m.peak_reserved_mb = memory.peak_reserved_mb()
    apply_device_monitor(m, device.type, nvml, samples)
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_flops(device_label, precision_mode) if precision_mode else None
    m.mfu = mfu_percent(m.flops_per_sample, m.throughput, peak)
    hardware_flops = m.hardware_flops_per_sample or m.flops_per_sample
    m.hfu = mfu_percent(hardware_flops, m.throughput, peak)


def apply_device_monitor(m: Metrics, device_type: str, nvml: Any, samples: int) -> None:
    """Utilization, power and energy: NVML's numbers on NVIDIA (null where NVML is absent);
    on CPU, utilization = 100 - data_wait (the share of the window spent computing)."""
    if device_type == "cpu":
        m.utilization = None if m.data_wait is None else 100.0 - m.data_wait
        return
    m.utilization = nvml.utilization if nvml is not None else None
    m.power_w = nvml.power_w if nvml is not None else None
    m.utilization_source = getattr(nvml, "utilization_source", None)
    m.power_source = getattr(nvml, "power_source", None)
    energy = nvml.energy_j if nvml is not None else None
    m.energy_per_sample_j = energy / samples if energy is not None and samples else None
