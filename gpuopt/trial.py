"""One trial: build the workload a `TrialSpec` describes, run the standard training step, measure it.

Workload contract (what a user's own model and dataset must follow):

- The dataset (`data._target_`, a `torch.utils.data.Dataset`) yields `(inputs, targets)` pairs of
  tensors; the DataLoader's default collate stacks them into batches.
- The model (`model._target_`, an `nn.Module`) is called as `model(inputs)` and returns `outputs`.
  Keys of the model config listed in `gpuopt.config.MODEL_META_KEYS` (input, input_shape,
  num_classes, channels_last) describe the model to gpuopt and are not passed to the constructor;
  every other key is a constructor argument.
- The loss (`loss`) is `cross_entropy(outputs.reshape(-1, C), targets.reshape(-1))` with C the last
  dimension of `outputs` (classification or next-token prediction; targets are int64 class ids),
  or `mse(outputs, targets)` (targets of the outputs' shape).
- The step is the standard one: forward (under autocast for fp16/bf16), loss, backward (through a
  GradScaler for fp16), optimizer step, zero_grad(set_to_none=True).
- User modules must be trusted: `trust=[mypkg.*]` (Hydra's execution whitelist).

Order of work, each part timed apart: build -> FLOP count (one step, outside the window) -> first
step through torch.compile (compile_time_s) -> warm-up (warmup_time_s) -> timed window (monitors on)
-> compute ceiling (one on-device batch, no loader). Failures become results: out-of-memory -> oom,
NaN/inf loss -> diverged, anything else -> error with the exception's type and message.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuopt.config import MODEL_META_KEYS, TrialSpec
from gpuopt.measure import (
    StopRule,
    WindowResult,
    count_step_flops,
    make_clock,
    mfu_percent,
    peak_flops,
    relative_ci_halfwidth,
    run_window,
    step_stats,
    synchronize,
    time_replay,
)
from gpuopt.result import Metrics, Status, TrialResult

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Trials run so far in this process: startup_time_s counts from process start only for the first.
_trials_in_process = 0
# Compute-ceiling steps run (unmeasured) before timing it: the model is already warm, this only
# re-warms caches for the replayed batch.
CEILING_WARMUP_STEPS = 1
# The ceiling replay stops after this share of measure.time_budget_s (or measure.ceiling_steps).
CEILING_BUDGET_SHARE = 0.25


class Diverged(Exception):
    """The loss became NaN or inf."""


def process_start_time() -> float | None:
    """When this process started (time.time() epoch), from /proc on Linux; None elsewhere.

    Uses the process's age (uptime - starttime, 10 ms resolution) rather than /proc/stat's btime,
    which has only 1 s resolution.
    """
    try:
        import os

        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 (starttime); fields[0] is field 3 (state)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_MODULE_LOADED_AT = time.time()  # the fallback "earliest timestamp" when /proc is absent


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), the CPU allocator's failure, MPS's out-of-memory error."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
    )


def peak_rss_mb() -> float:
    """The process's peak resident set size so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def compute_loss(loss_name: str, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The `loss` config: cross_entropy over the last dimension of `outputs`, or mse."""
    import torch.nn.functional as F

    if loss_name == "mse":
        return F.mse_loss(outputs, targets.to(outputs.dtype))
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


@dataclass
class Workload:
    """The built pieces of a trial and the standard training step over them."""

    model: torch.nn.Module  # eager module (FLOP counting, checkpointing)
    forward: Callable[..., Any]  # the module, or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    precision: Any  # gpuopt.policies.PrecisionPolicy
    loss_name: str
    device: torch.device
    channels_last: bool
    non_blocking: bool
    nonfinite: torch.Tensor  # device-side flag: any loss so far NaN/inf (read only at window ends)

    def to_device(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        # non_blocking=True from pinned memory: the host does not wait for the copy. From pageable
        # memory, or with non_blocking=False, the host waits (a sync on the current stream).
        inputs = inputs.to(self.device, non_blocking=self.non_blocking)
        targets = targets.to(self.device, non_blocking=self.non_blocking)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return compute_loss(self.loss_name, outputs, targets)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            loss = self.loss(self.forward(inputs), targets)
        scaler = self.precision.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        import torch

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
        # Accumulate on the device: reading the loss on the host here would sync every step.
        torch.logical_or(self.nonfinite, ~torch.isfinite(loss.detach()), out=self.nonfinite)

    def check_finite(self, phase: str) -> None:
        if bool(self.nonfinite):  # a CPU-GPU sync point: only at window ends
            raise Diverged(f"loss became NaN/inf during {phase}")


class BatchFeed:
    """Endless batches from the DataLoader (restarting it at each epoch end), already on the device,
    with the time the host was blocked waiting for them."""

    def __init__(self, loader: Any, workload: Workload) -> None:
        import torch

        self.loader = loader
        self.workload = workload
        self.iterator: Any = None
        self.batches = 0
        self.wait_s = 0.0
        # A synchronous H2D copy on CUDA also waits for queued compute; time the copy itself on the
        # stream with events instead of on the host.
        self.time_copies = workload.device.type == "cuda" and not workload.non_blocking
        self._copy_events: list[tuple[Any, Any]] = []
        self._torch = torch

    def reset_counters(self) -> None:
        self.batches, self.wait_s, self._copy_events = 0, 0.0, []

    def copy_seconds(self) -> float:
        """GPU time of the synchronous H2D copies since reset (call after a synchronize)."""
        return sum(start.elapsed_time(end) for start, end in self._copy_events) / 1e3

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        if self.iterator is None:
            self.iterator = iter(self.loader)
        try:
            inputs, targets = next(self.iterator)
        except StopIteration:  # epoch end: a new iterator (new workers unless persistent_workers)
            self.iterator = iter(self.loader)
            inputs, targets = next(self.iterator)
        self.wait_s += time.perf_counter() - started
        self.batches += 1
        if self.time_copies:
            start, end = (self._torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            batch = self.workload.to_device(inputs, targets)
            end.record()
            self._copy_events.append((start, end))
            return batch
        return self.workload.to_device(inputs, targets)

    def close(self) -> None:
        """Stop the worker processes (they would compete with the ceiling measurement)."""
        iterator, self.iterator = self.iterator, None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _instantiate(config: dict[str, Any], trusted: tuple[str, ...], **kwargs: Any) -> Any:
    from hydra.utils import instantiate

    # Hydra 1.4's execution whitelist: only trusted `_target_`s (also nested ones) may be called.
    return instantiate(config, _execution_whitelist_=list(trusted), _convert_="all", **kwargs)


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


@dataclass
class _Trial:
    """Everything a trial holds, so failures can release it and partial metrics survive."""

    spec: TrialSpec
    device: torch.device
    metrics: Metrics = field(default_factory=Metrics)
    warnings: list[str] = field(default_factory=list)
    workload: Workload | None = None
    feed: BatchFeed | None = None
    inspect: Callable[[str, Any], None] | None = None


def _build(trial: _Trial) -> None:
    import torch

    from gpuopt import policies

    spec, device = trial.spec, trial.device
    policies.set_num_threads(spec.device.num_threads)
    precision = policies.precision_policy(spec.precision, device)
    policies.CachePolicy(spec.cache, device).apply()
    torch.manual_seed(spec.seed)
    dataset = _instantiate(spec.data, spec.trusted_targets)
    model_kwargs = {k: v for k, v in spec.model.items() if k not in MODEL_META_KEYS}
    model = _instantiate(model_kwargs, spec.trusted_targets)
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
    trial.workload = Workload(
        model=model,
        forward=policies.compile_function(model, spec.compile),
        optimizer=optimizer,
        precision=precision,
        loss_name=spec.loss,
        device=device,
        channels_last=channels_last,
        non_blocking=spec.loader.non_blocking,
        nonfinite=torch.zeros((), dtype=torch.bool, device=device),
    )
    trial.feed = BatchFeed(loader, trial.workload)
    if trial.inspect is not None:
        trial.inspect("loader", loader)
        trial.inspect("model", model)
        trial.inspect("workload", trial.workload)


def _count_flops(trial: _Trial, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    workload = trial.workload
    assert workload is not None
    eager, workload.forward = workload.forward, workload.model  # count on the eager module

    def forward_backward() -> None:
        workload.forward_backward(*batch)

    try:
        flops = count_step_flops(forward_backward)
    finally:
        workload.forward = eager
        workload.optimizer.zero_grad(set_to_none=True)
    trial.metrics.flops_per_sample = flops / trial.spec.loader.batch_size if flops else None


def _measure(trial: _Trial, process_t0: float) -> None:
    import torch

    from gpuopt import monitor
    from gpuopt.policies import CachePolicy

    spec, device, m = trial.spec, trial.device, trial.metrics
    measure = spec.measure
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before_mb = peak_rss_mb()
    _build(trial)
    workload, feed = trial.workload, trial.feed
    assert workload is not None and feed is not None
    cache_policy = CachePolicy(spec.cache, device)

    first_batch = feed.next()
    if measure.count_flops:
        _count_flops(trial, first_batch)

    # torch.compile compiles lazily on the first call: time that step apart (compile + one step).
    m.compile_time_s = 0.0
    if spec.compile.mode != "off":
        started = time.perf_counter()
        workload.train_step(*first_batch)
        synchronize(device)
        m.compile_time_s = time.perf_counter() - started

    started = time.perf_counter()
    for _ in range(measure.warmup_steps):
        workload.train_step(*feed.next())
    synchronize(device)
    m.warmup_time_s = time.perf_counter() - started
    workload.check_finite("warm-up")

    sampler, note = monitor.open_sampler(device, measure.nvml_interval_s)
    if note:
        trial.warnings.append(note)

    def step(index: int) -> None:
        workload.train_step(*feed.next())
        cache_policy.after_step(index)

    rule = StopRule.from_measure(measure)
    feed.reset_counters()
    if sampler is not None:
        sampler.start()
    try:
        window = run_window(step, make_clock(device), rule)
    finally:
        nvml = sampler.stop() if sampler is not None else None
    # clock.finish() synchronized: the window's work (and copies) has completed.
    waited = feed.wait_s + (feed.copy_seconds() if feed.time_copies else 0.0)
    record_window(
        m,
        window,
        window.steps * spec.loader.batch_size,
        waited,
        device,
        nvml,
        rss_before_mb,
        spec.precision.mode,
        process_t0,
    )
    workload.check_finite("the timed window")

    if measure.ceiling:
        feed.close()
        batch = first_batch

        def replay(_: int) -> None:
            workload.train_step(*batch)

        for i in range(CEILING_WARMUP_STEPS):
            replay(i)
        budget = CEILING_BUDGET_SHARE * measure.time_budget_s
        steps, seconds = time_replay(replay, measure.ceiling_steps, device, budget)
        m.ceiling_throughput = steps * spec.loader.batch_size / seconds
        m.input_efficiency = 100.0 * m.throughput / m.ceiling_throughput
        workload.check_finite("the compute-ceiling replay")


def record_window(
    m: Metrics,
    window: WindowResult,
    samples: int,
    waited_s: float,
    device: torch.device,
    nvml: Any,
    rss_before_mb: float,
    precision_mode: str | None,
    process_t0: float,
) -> None:
    """The timed window's metrics (both engines): throughput, step-time statistics, data wait,
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
    if device.type == "cuda":
        m.peak_memory_mb = torch.cuda.max_memory_allocated(device) / 2**20
    elif device.type == "cpu":
        m.peak_memory_mb = max(0.0, peak_rss_mb() - rss_before_mb)
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


def _release(trial: _Trial, status: Status) -> None:
    from gpuopt.policies import CachePolicy, empty_device_cache

    if trial.feed is not None:
        trial.feed.close()
    trial.workload = trial.feed = None
    gc.collect()
    CachePolicy(trial.spec.cache, trial.device).at_trial_end()
    if status is Status.OOM:
        # After an OOM the cache holds the failed trial's blocks: always give them back, so the
        # next trial in this process starts from an empty device.
        empty_device_cache(trial.device)


def engine_measure(spec: TrialSpec) -> Callable[[_Trial, float], None]:
    """The engine that runs and measures the trial (`engine.name`): gpuopt's own loop, or
    lightning.Trainer (imported only when chosen: an optional extra that takes seconds to import)."""
    if spec.engine.name == "lightning":
        from gpuopt.engines.lightning import measure_lightning

        return measure_lightning
    return _measure


def spec_to_dict(spec: TrialSpec) -> dict[str, Any]:
    data = dataclasses.asdict(spec)
    data["trusted_targets"] = list(spec.trusted_targets)
    return data


def run_trial(
    spec: TrialSpec,
    device: torch.device | None = None,
    inspect: Callable[[str, Any], None] | None = None,
) -> TrialResult:
    """Build and measure one configuration. Never raises for a failing workload: OOM, divergence and
    errors come back as the result's status. `inspect(name, obj)` sees the built loader and model."""
    global _trials_in_process
    from gpuopt.env import fingerprint, resolve_device

    trial_t0 = time.time()
    process_t0 = (
        (process_start_time() or _MODULE_LOADED_AT) if _trials_in_process == 0 else trial_t0
    )
    _trials_in_process += 1
    device = device if device is not None else resolve_device(spec.device.type)
    trial = _Trial(spec, device, inspect=inspect)
    status, reason = Status.OK, None
    try:
        engine_measure(spec)(trial, process_t0)
    except Diverged as exc:
        status, reason = Status.DIVERGED, str(exc)
    except Exception as exc:
        if is_oom(exc):
            status = Status.OOM
        else:
            status = Status.ERROR
            log.warning("trial failed", exc_info=True)
        reason = f"{type(exc).__name__}: {str(exc).strip()}"
    finally:
        _release(trial, status)
    if _trials_in_process > 1:
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
