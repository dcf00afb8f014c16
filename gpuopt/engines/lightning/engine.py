"""The Lightning engine (`engine=lightning`): the trial runs through `lightning.Trainer.fit`, measured
by a Callback with the same clocks, stop rule, monitors and metrics as gpuopt's own loop.

gpuopt's keys map onto Lightning's own knobs: precision -> `Trainer(precision=...)`, compile ->
`torch.compile(LightningModule)`, loader.* -> gpuopt's DataLoader for a Dataset, the arguments a
LightningDataModule's constructor takes for one. Distributed: each rank of gpuopt's own launch
fits with a Lightning strategy (`lightning_strategy`); the compute ceiling is left out, as by the
native engine. The ranks are gpuopt's (gpuopt.trial.distributed starts them): Lightning detects
the launcher's `TorchElasticEnvironment`, whose `creates_processes_externally` keeps it from
launching processes of its own (its DDP launcher re-executes `sys.argv`, which under a Hydra
multirun starts a new sweep per rank: Lightning #11617, #18175, Hydra #2070), and leaves the
group gpuopt set up as it is.

The model is a plain `nn.Module`, wrapped in `BuiltinModule` with gpuopt's loss and optimizer, or
the user's own `LightningModule`, run as is. After the fit, outside any timed span: the profiled
window (a short extra fit), the epoch boundary, the input pipeline's cost, and the compute ceiling
(the fit's first batch replayed through a second `Trainer.fit`).

Nothing is written to the working directory: no checkpoints, no logger, no progress bar;
`default_root_dir` is the Hydra run dir (or a temporary directory outside Hydra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import logging
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.utilities.data import extract_batch_size

from gpuopt.core.spec import TrialSpec
from gpuopt.engines._batches import build_loader, move_batch, record_batches, stop_workers
from gpuopt.engines._build import (
    apply_policies,
    build_loss,
    build_optimizer,
    instantiate_data,
    instantiate_model,
)
from gpuopt.engines._ceiling import CeilingReplay, record_limits
from gpuopt.engines._distributed import Ranks, checkpoint, ddp_kwargs, shard
from gpuopt.engines._epoch import beside_window
from gpuopt.engines._guard import guard_numerics
from gpuopt.engines._loss import model_loss, step_loss
from gpuopt.engines._window import record_profile
from gpuopt.engines.lightning.fit_profile import profiled_fit
from gpuopt.engines.lightning.meter import (
    FetchTimer,
    MeasureCallback,
    lightning_precision,
    peak_mode,
)
from gpuopt.trial import library_bugs, policies
from gpuopt.trial.context import Trial
from gpuopt.trial.failures import NonFiniteLoss
from gpuopt.trial.memory import MemoryBaseline

# The data-parallel dimension of ModelParallelStrategy's device mesh.
DATA_PARALLEL = "data_parallel"
# Warnings Lightning gives for every trial that say nothing about the configuration.
_IGNORED_WARNINGS = (
    "does not have many workers",  # gpuopt's loader group is the place to tune num_workers
    "GPU available but not used",
    "`max_epochs=-1`",
    "treespec",  # Lightning 2.6's use of a torch pytree API that torch 2.13 deprecates
    # A machine with SLURM installed, on every fit (its checkpoint connector probes SLURM): gpuopt
    # starts its own processes, under its SLURM launcher too, so the hint to use srun is not one.
    "`srun` command is available",
)


class BuiltinModule(pl.LightningModule):
    """A plain `nn.Module` (a built-in family or the user's own) trained the gpuopt way: the loss
    named by `loss`, the optimizer group, channels_last inputs when the model is channels_last."""

    def __init__(self, model: torch.nn.Module, spec: TrialSpec) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.channels_last = bool(spec.model.get("channels_last", False))
        self.loss = build_loss(spec)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.channels_last:
            batch = move_batch(batch, self.device, channels_last=True)
        return model_loss(self, batch, self.loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.spec, self.model.parameters())

    def configure_model(self) -> None:
        """`distributed=fsdp2`: the model sharded on the strategy's data-parallel mesh, once
        (Lightning calls this hook on every fit)."""
        conf = self.spec.distributed
        if conf.kind != "fsdp2" or getattr(self, "_sharded", False):
            return
        checkpoint(self.model, conf)
        shard(self.model, conf, self.device_mesh[DATA_PARALLEL])
        self._sharded = True


class CeilingCallback(pl.Callback):
    """The compute ceiling under Lightning: `replay` times the steps of a fit over one batch
    already on the device (Lightning's per-step work included)."""

    def __init__(self, replay: CeilingReplay) -> None:
        self.replay = replay
        self.nonfinite = NonFiniteLoss()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.replay.begin()

    def on_train_batch_end(
        self, trainer: pl.Trainer, _: Any, outputs: Any, batch: Any, *__: Any
    ) -> None:
        self.nonfinite.update(step_loss(outputs))
        if self.replay.step_done(extract_batch_size(batch)):
            trainer.should_stop = True
            self.nonfinite.check("the compute-ceiling replay")


class _RepeatedBatch:
    """One batch, `length` times: the ceiling's 'data loader' (no loader work, already on device)."""

    def __init__(self, batch: Any, length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        return (self.batch for _ in range(self.length))


def _datamodule_loader_kwargs(
    spec: TrialSpec, cls: type, device: torch.device, notes: list[str]
) -> dict[str, Any]:
    """The loader knobs a DataModule's constructor accepts (loader.* wins over data.*)."""
    params = inspect.signature(cls.__init__).parameters
    knobs = dataclasses.asdict(spec.loader)
    # Page-locked memory only helps host-to-device copies; without an accelerator it is a no-op.
    knobs["pin_memory"] = knobs["pin_memory"] and device.type != "cpu"
    defaults = dataclasses.asdict(type(spec.loader)())
    accepted = {k: v for k, v in knobs.items() if k in params}
    overridden = sorted(k for k in accepted if k in spec.data and spec.data[k] != accepted[k])
    if overridden:
        notes.append(f"data.{', data.'.join(overridden)} replaced by the loader group's value(s)")
    ignored = sorted(k for k, v in knobs.items() if k not in params and v != defaults[k])
    if ignored:
        notes.append(
            f"loader.{', loader.'.join(ignored)} not applied: {cls.__name__}.__init__ does not take them"
        )
    return accepted


def build_lightning_workload(
    spec: TrialSpec, device: torch.device, notes: list[str], ranks: Ranks | None = None
) -> tuple[pl.LightningModule, dict[str, Any]]:
    """The LightningModule to fit and the data arguments of `Trainer.fit` (under `ranks` gpuopt's
    own loader draws from the rank's own seed)."""
    from hydra.utils import get_object

    torch.manual_seed(spec.seed)
    built = instantiate_model(spec)
    if isinstance(built, pl.LightningModule):
        module = built
        if spec.model.get("channels_last"):
            notes.append(
                "model.channels_last not applied: a LightningModule formats its own inputs"
            )
    elif isinstance(built, torch.nn.Module):
        if spec.model.get("channels_last"):
            library_bugs.check_channels_last(built, device, spec.precision.mode)
            built = built.to(memory_format=torch.channels_last)
        module = BuiltinModule(built, spec)
    else:
        raise TypeError(
            f"model._target_={spec.model['_target_']} built a {type(built).__name__}, "
            "not an nn.Module or LightningModule"
        )
    if spec.distributed.kind == "ddp":
        checkpoint(built, spec.distributed)

    data_target = spec.data.get("_target_")
    data_cls = get_object(data_target) if data_target else None
    if isinstance(data_cls, type) and issubclass(data_cls, pl.LightningDataModule):
        kwargs = _datamodule_loader_kwargs(spec, data_cls, device, notes)
        return module, {"datamodule": instantiate_data(spec, **kwargs)}
    hook = pl.LightningModule.train_dataloader
    if isinstance(built, pl.LightningModule) and type(built).train_dataloader is not hook:
        if data_target:
            notes.append(
                f"data ({data_target}) and the loader group not used: "
                f"{type(built).__name__} brings its own train_dataloader"
            )
        return module, {}
    # (No data and no train_dataloader of its own: gpuopt.trial.prepare's ConfigError, upstream.)
    dataset = instantiate_data(spec)
    seed = spec.seed + ranks.rank if ranks is not None else None  # a rank's own samples
    return module, {"train_dataloaders": build_loader(spec, dataset, device, notes, seed)}


def lightning_strategy(spec: TrialSpec) -> str | Strategy:
    """The Trainer's `strategy`: `engine.strategy` for one process, else the distributed kind's:
    `DDPStrategy` with the DDP knobs as DistributedDataParallel's own arguments, or for `fsdp2`
    `ModelParallelStrategy` on a 1-D data-parallel mesh (its `FSDPStrategy` is FSDP1's wrapper
    class, another implementation; the sharding is `BuiltinModule.configure_model`'s, while a
    user's LightningModule shards itself, out of reach of gpuopt's FSDP2 knobs). Lightning 2.6
    reduces the gradients of every micro-batch under ModelParallelStrategy (its
    `block_backward_sync` skips only DDP's): what a Lightning FSDP2 job with accumulation costs."""
    conf = spec.distributed
    if conf.kind == "none":
        return spec.engine.strategy
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    backend = str(torch.distributed.get_backend()) if initialized else None
    timeout = datetime.timedelta(seconds=conf.timeout_s)
    if conf.kind == "ddp":
        return DDPStrategy(process_group_backend=backend, timeout=timeout, **ddp_kwargs(conf))
    return ModelParallelStrategy(
        data_parallel_size=conf.world_size,
        tensor_parallel_size=1,
        process_group_backend=backend,
        timeout=timeout,
    )


def trainer_devices(spec: TrialSpec, device: torch.device) -> dict[str, Any]:
    """The Trainer's accelerator, devices and num_nodes: the trial's one device, or for a
    distributed trial every rank's devices of this node (Lightning picks LOCAL_RANK's) over
    `nnodes` nodes, in the launcher's environment, named (inside a SLURM job too: not a guess)."""
    conf = spec.distributed
    if conf.kind != "none":
        return {
            "accelerator": device.type,
            "devices": conf.nproc_per_node,
            "num_nodes": conf.nnodes,
            "plugins": [TorchElasticEnvironment()],
        }
    if device.type == "cuda":
        return {"accelerator": "cuda", "devices": [device.index or 0]}
    return {"accelerator": device.type, "devices": 1}


def make_trainer(
    spec: TrialSpec,
    device: torch.device,
    callbacks: list[pl.Callback],
    profiler: Profiler | None,
    root: Path,
    own_loader: bool = True,
) -> pl.Trainer:
    """The trial's Trainer. `own_loader`: the train loader is gpuopt's (its sampler's epoch lasts
    the trial, each rank seeded apart), so Lightning does not replace its sampler."""
    return pl.Trainer(
        **trainer_devices(spec, device),
        strategy=lightning_strategy(spec),
        use_distributed_sampler=not own_loader,
        precision=lightning_precision(spec),  # type: ignore[arg-type]
        benchmark=bool(spec.cache.cudnn_benchmark),
        # Lightning divides each micro-batch loss by this count itself.
        accumulate_grad_batches=spec.accumulation_steps,
        gradient_clip_val=spec.engine.gradient_clip_val,
        # The callback ends the fit (trainer.should_stop); epochs restart the loader as needed.
        max_epochs=-1,
        max_steps=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        profiler=profiler,
        # Nothing into the user's cwd: no checkpoints, no logs, no progress bar.
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )


@contextlib.contextmanager
def _trainer_root() -> Iterator[Path]:
    """Hydra's run dir when inside a Hydra job, else a temporary directory removed afterwards."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and HydraConfig.get().runtime.output_dir:
        yield Path(HydraConfig.get().runtime.output_dir)
        return
    with tempfile.TemporaryDirectory(prefix="gpuopt-lightning-") as root:
        yield Path(root)


@contextlib.contextmanager
def _lightning_output(notes: list[str]) -> Iterator[None]:
    """Quiet Lightning's per-fit info lines; keep its warnings about the configuration as notes."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=False):
            lg.setLevel(level)
    seen: set[str] = set()
    for warning in caught:
        text = str(warning.message).strip().splitlines()[0]
        if text in seen or any(ignored in text for ignored in _IGNORED_WARNINGS):
            continue
        seen.add(text)
        notes.append(f"lightning: {text}")


def measure(trial: Trial, process_t0: float) -> None:
    """The engine: fill `trial.metrics` by fitting with lightning.Trainer, raising on failure."""
    trial.after_release.append(guard_numerics)
    spec, device = trial.spec, trial.device
    memory = MemoryBaseline.take(device)
    # Process-wide settings, float32 matmul precision (TF32 on/off) included. Lightning's precision
    # plugin does the autocast and the fp16 GradScaler: the precision policy is not used here.
    cache_policy = apply_policies(spec, device).cache
    record_batches(trial)
    # A distributed trial's rank (None in one process): the process group is already up.
    ranks = Ranks.current(spec, device)
    module, fit_data = build_lightning_workload(spec, device, trial.warnings, ranks)
    trial.show("module", module)
    trial.show("fit_data", fit_data)
    # Lightning recognises the compiled wrapper and compiles forward and training_step.
    fit_module = policies.compile_function(module, spec.compile)
    fetch_timer = FetchTimer(device)
    meter = MeasureCallback(trial, fetch_timer, cache_policy, memory, ranks)
    own_loader = "train_dataloaders" in fit_data
    with _trainer_root() as root, _lightning_output(trial.warnings):
        trainer = make_trainer(spec, device, [meter], fetch_timer, root, own_loader)
        trial.show("trainer", trainer)
        trainer.fit(fit_module, **fit_data)
        meter.meter.record(process_t0)
        loader_cost = _beside_fit(trial, trainer.train_dataloader, fetch_timer.wait.fetch_s)
        batch, meter.first_batch = meter.first_batch, None
        if spec.profile.enabled:  # every rank alike: the same steps, after a barrier
            trainer_for = functools.partial(
                make_trainer, spec, device, root=root, own_loader=own_loader
            )
            summary = profiled_fit(trial, trainer.lightning_module, fit_data, trainer_for, ranks)
            record_profile(trial, summary)
        # trainer.lightning_module: the fitted module (already compiled, if compile is on).
        replay = functools.partial(_compute_ceiling, trial, trainer.lightning_module, batch, root)
        record_limits(trial, ranks, loader_cost, replay, peak_mode(spec))


def _beside_fit(trial: Trial, loader: Any, fetch_wait_s: float) -> float | None:
    """The epoch boundary's and the input pipeline's costs, for a torch DataLoader (a
    CombinedLoader or a user's own iterable is not priced)."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        trial.warnings.append(
            "epoch_overhead_s and loader_cost_us not measured: the train dataloader is a "
            f"{type(loader).__name__}, not one torch DataLoader"
        )
        return beside_window(trial, None, 0.0, lambda: None)
    # Persistent workers stopped before the ceiling runs (the fit stopped the others).
    return beside_window(
        trial, loader, fetch_wait_s, lambda: stop_workers(getattr(loader, "_iterator", None))
    )


def _compute_ceiling(
    trial: Trial, module: pl.LightningModule, batch: Any, root: Path
) -> CeilingReplay:
    """The fitted module trained on `batch` (on the device) by a second fit, no loader."""
    replay = CeilingReplay.for_trial(trial.spec, trial.device)
    ceiling = CeilingCallback(replay)
    trainer = make_trainer(trial.spec, trial.device, [ceiling], None, root)
    trainer.fit(
        module, train_dataloaders=_RepeatedBatch(batch, replay.warmup_steps + replay.max_steps)
    )
    replay.record(trial.metrics)
    return replay
