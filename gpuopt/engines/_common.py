"""What every training engine shares: building the workload, the trial's lifecycle and failure
classification, the monitors beside the timed window, the compute ceiling, and the window's metrics.

Engines (`gpuopt.engines.native`, `gpuopt.engines.lightning`) import from here and never from each
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
  Keys of the model config listed in `gpuopt.config.MODEL_META_KEYS` (input, input_shape,
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

from gpuopt.config import MODEL_META_KEYS, TrialSpec
from gpuopt.measure import (
    WindowResult,
    mfu_percent,
    peak_flops,
    relative_ci_halfwidth,
    step_stats,
    synchronize,
)
from gpuopt.result import Metrics, Status, TrialResult

if TYPE_CHECKING:
    import torch

    from gpuopt.config import EngineConf, LoaderConf, MeasureConf
    from gpuopt.policies import CachePolicy, PrecisionPolicy

log = logging.getLogger(__name__)

# Compute-ceiling steps run (unmeasured) before timing it: the model is already warm, this only
# re-warms caches for the replayed batch.
CEILING_WARMUP_STEPS = 1
# The ceiling replay stops after this share of measure.time_budget_s (or measure.ceiling_steps).
CEILING_BUDGET_SHARE = 0.25
# ... but not before this many timed replay steps.
CEILING_MIN_STEPS = 3


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
    from gpuopt import config

    return TrialSpec(
        model={},
        data={},
        loader=loader or config.LoaderConf(),
        precision=config.PrecisionConf(mode=precision_mode),
        compile=config.CompileConf(mode=compile_mode),
        cache=config.CacheConf(),
        optimizer=config.OptimizerConf(),
        device=config.DeviceConf(type=str(device)),
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
    return TrialResult(
        status=status,
        metrics=trial.metrics,
        reason=reason,
        config=spec_to_dict(spec),
        env=fingerprint(device),
        warnings=trial.warnings,
    )


def release(trial: Trial, status: Status) -> None:
    """Let go of what the trial built and give the allocator's cache back as the cache policy
    says (always after an OOM). In-process clean-up between trials belongs here."""
    from gpuopt.policies import CachePolicy, empty_device_cache

    for resource_ in trial.resources:
        close = getattr(resource_, "close", None)
        if callable(close):
            close()
    trial.resources.clear()
    gc.collect()
    CachePolicy(trial.spec.cache, trial.device).at_trial_end()
    if status is Status.OOM:
        # After an OOM the cache holds the failed trial's blocks: always give them back, so the
        # next trial in this process starts from an empty device.
        empty_device_cache(trial.device)


# -- failure classification -----------------------------------------------------------------------
class Diverged(Exception):
    """The loss became NaN or inf."""


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), the CPU allocator's failure, MPS's out-of-memory error."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
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
    from gpuopt import policies

    policies.set_num_threads(spec.device.num_threads)
    precision = policies.precision_policy(spec.precision, device)
    cache = policies.CachePolicy(spec.cache, device)
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
    """The data config's object (a Dataset, or under Lightning a LightningDataModule)."""
    return instantiate_trusted(spec.data, spec.trusted_targets, **kwargs)


def compute_loss(loss_name: str, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The `loss` config: cross_entropy over the last dimension of `outputs`, or mse."""
    import torch.nn.functional as F

    if loss_name == "mse":
        return F.mse_loss(outputs, targets.to(outputs.dtype))
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def build_optimizer(spec: TrialSpec, params: Any) -> torch.optim.Optimizer:
    import torch

    conf = spec.optimizer
    kwargs: dict[str, Any] = {"lr": conf.lr, "weight_decay": conf.weight_decay}
    if conf.foreach is not None:
        kwargs["foreach"] = conf.foreach
    if conf.fused is not None:
        kwargs["fused"] = conf.fused
    if conf.name == "sgd":
        return torch.optim.SGD(params, momentum=conf.momentum, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


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
    return DataLoader(
        dataset,
        batch_size=conf.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(spec.seed),
        num_workers=conf.num_workers,
        # Page-locked host buffers: needed for truly asynchronous H2D copies. Without an
        # accelerator PyTorch ignores it (with a warning).
        pin_memory=conf.pin_memory and device.type != "cpu",
        drop_last=conf.drop_last,
        **kwargs,
    )


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
        time_copies: bool,
        samples: SampleCount = None,
    ) -> None:
        self.loader, self.move, self.sample_count = loader, move, samples
        self.iterator: Any = None
        self.batches = self.samples = 0
        # A synchronous H2D copy on CUDA also waits for queued compute: time the copy itself on
        # the stream with events instead of on the host.
        self.wait = InputWait(time_copies=time_copies)

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

    def close(self) -> None:
        """Stop the worker processes (they would compete with the ceiling measurement)."""
        iterator, self.iterator = self.iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def measure_timed_window(
    trial: Trial,
    train_step: Callable[[Any], None],
    feed: BatchFeed,
    memory: MemoryBaseline,
    precision_mode: str | None,
    process_t0: float,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """The timed window of a loop engine: `train_step(feed.next())` until `gpuopt.measure.StopRule`
    says stop, with the monitors on, then the window's metrics (`record_window`)."""
    from gpuopt.measure import StopRule, make_clock, run_window

    measure, device = trial.spec.measure, trial.device
    monitors = WindowMonitors(device, measure.nvml_interval_s, trial.warnings)

    def step(index: int) -> None:
        train_step(feed.next())
        if after_step is not None:
            after_step(index)

    feed.reset_counters()
    monitors.start()
    try:
        window = run_window(step, make_clock(device), StopRule.from_measure(measure))
    finally:
        nvml = monitors.stop()
    # clock.finish() synchronized: the window's work (and copies) has completed.
    waited_s = feed.wait.seconds()
    record_window(
        trial.metrics,
        window,
        feed.samples,
        waited_s,
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
    """Where `peak_memory_mb` counts from: the device's peak statistics are reset, and the host's
    peak RSS noted, when this is taken (both engines: before the trial builds anything)."""

    device: torch.device
    rss_before_mb: float

    @classmethod
    def take(cls, device: torch.device) -> MemoryBaseline:
        import torch

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        return cls(device, peak_rss_mb())

    def peak_mb(self) -> float | None:
        """The peak since the baseline: CUDA's allocator peak, the CPU's RSS growth, else None."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.device.type == "cpu":
            return max(0.0, peak_rss_mb() - self.rss_before_mb)
        return None


# -- beside the timed window ----------------------------------------------------------------------
class WindowMonitors:
    """The NVML sampler running beside the timed window (none where NVML is absent: a note says
    why). `stop` may be called more than once (the window's end, then a failure's clean-up)."""

    def __init__(self, device: torch.device, interval_s: float, notes: list[str]) -> None:
        self.device, self.interval_s, self.notes = device, interval_s, notes
        self._sampler: Any = None

    def start(self) -> None:
        from gpuopt import monitor

        sampler, note = monitor.open_sampler(self.device, self.interval_s)
        if note:
            self.notes.append(note)
        self._sampler = sampler
        if sampler is not None:
            sampler.start()

    def stop(self) -> Any:
        """The window's NVML statistics (`gpuopt.monitor.NvmlStats`), or None without a sampler."""
        sampler, self._sampler = self._sampler, None
        return sampler.stop() if sampler is not None else None


class InputWait:
    """What the input pipeline costs the loop inside the timed window: the host time blocked
    fetching the next batch, plus (when `time_copies`) the GPU time of the host-to-device copies,
    timed with CUDA events on the stream (a copy's host time would include waiting for queued
    compute). Each engine marks the fetch and copy spans of its own loop."""

    def __init__(self, time_copies: bool) -> None:
        self.time_copies = time_copies
        self.fetch_s = 0.0
        self._fetch_t0: float | None = None
        self._copy_events: list[tuple[Any, Any]] = []
        self._copy_start: Any = None

    def reset(self) -> None:
        self.fetch_s, self._copy_events = 0.0, []

    def fetch_started(self) -> None:
        self._fetch_t0 = time.perf_counter()

    def fetch_ended(self) -> None:
        if self._fetch_t0 is not None:
            self.fetch_s += time.perf_counter() - self._fetch_t0
            self._fetch_t0 = None

    def copy_started(self) -> None:
        if self.time_copies:
            import torch

            self._copy_start = torch.cuda.Event(enable_timing=True)
            self._copy_start.record()

    def copy_ended(self) -> None:
        if self._copy_start is not None:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._copy_events.append((self._copy_start, end))
            self._copy_start = None

    def seconds(self) -> float:
        """Fetch + copy time since the reset (call after the window's closing synchronize)."""
        return self.fetch_s + sum(a.elapsed_time(b) for a, b in self._copy_events) / 1e3


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
        self._t0 = 0.0

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
        self.seconds = None
        if self.warmup_steps == 0:
            self._start_timing()

    def _start_timing(self) -> None:
        synchronize(self.device)
        self._t0 = time.perf_counter()

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


# -- the window's metrics -------------------------------------------------------------------------
def record_window(
    m: Metrics,
    window: WindowResult,
    samples: int,
    waited_s: float,
    device: torch.device,
    nvml: Any,
    memory: MemoryBaseline,
    precision_mode: str | None,
    process_t0: float,
) -> None:
    """The timed window's metrics (every engine): throughput, step-time statistics, data wait,
    peak memory, utilization/power/energy and MFU. Call after the window's closing synchronize."""
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
    m.data_wait = min(100.0, 100.0 * waited_s / window.wall_s)
    peak_memory = memory.peak_mb()
    if peak_memory is not None:
        m.peak_memory_mb = peak_memory
    apply_device_monitor(m, device.type, nvml, samples)
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_flops(device_label, precision_mode) if precision_mode else None
    m.mfu = mfu_percent(m.flops_per_sample, m.throughput, peak)


def apply_device_monitor(m: Metrics, device_type: str, nvml: Any, samples: int) -> None:
    """Utilization, power and energy: NVML's numbers on NVIDIA (null where NVML is absent);
    on CPU, utilization = 100 - data_wait (the share of the window spent computing)."""
    if device_type == "cpu":
        m.utilization = None if m.data_wait is None else 100.0 - m.data_wait
        return
    m.utilization = nvml.utilization if nvml is not None else None
    m.power_w = nvml.power_w if nvml is not None else None
    energy = nvml.energy_j if nvml is not None else None
    m.energy_per_sample_j = energy / samples if energy is not None and samples else None
