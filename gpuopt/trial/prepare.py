"""The torch side of the validation route: `prepare_trial(cfg)` turns a composed config into the
one checked TrialSpec and the device it runs on, or raises one `ConfigError`, before anything is
built. Every process that measures a trial enters here once: gpuopt.run (a single run's callback
before its run directory exists, a sweep's trial), and the sweeper's measuring processes
(gpuopt.processes.shared_windows, gpuopt.processes.memory_probe).

The route, each module once: the config's values, workload and distributed group checked without
torch (gpuopt.core.checks.check_composed: a bad value fails before seconds of imports) -> the
allocator settings into the environment (torch reads them when first imported) -> the `_target_`s
imported (the user's modules, hence torch), a user's LightningModule asked what only its class
can say -> the device checked against this process's facts and resolved (gpuopt.trial.devices).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuopt.core.checks import check_composed
from gpuopt.core.errors import ConfigError
from gpuopt.core.spec import DistributedConf
from gpuopt.trial.devices import trial_device
from gpuopt.trial.policies import apply_allocator_env

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from gpuopt.core.spec import TrialSpec


@dataclass(frozen=True)
class PreparedTrial:
    """A composed config checked and on its device: what the route hands the engine."""

    spec: TrialSpec
    device: torch.device
    warnings: list[str]  # the allocator's and the device's


def prepare_trial(cfg: DictConfig, run_dir: bool = False, allocator: bool = True) -> PreparedTrial:
    """The trial's one validation and its device, resolved once; raises ConfigError.

    `run_dir`: a single run's `hydra.run.dir` must be writable too. `allocator`: put the config's
    allocator settings into the environment first (they apply only before torch is imported; the
    warnings say when they did not); False in the sweeper's measuring processes, which measure in
    the environment they were started in."""
    spec = check_composed(cfg, run_dir=run_dir)
    warnings = (
        apply_allocator_env(spec.cache.cuda_alloc_conf, spec.cache.cpu_thp) if allocator else []
    )
    _import_targets(spec)
    device, device_warnings = trial_device(spec)
    return PreparedTrial(spec, device, [*warnings, *device_warnings])


def load_spec(cfg: DictConfig) -> TrialSpec:
    """The checked TrialSpec of a composed config, its targets imported, without a device (what
    tests and scripts build a spec from; a trial's route is `prepare_trial`)."""
    spec = check_composed(cfg)
    _import_targets(spec)
    return spec


def _import_targets(spec: TrialSpec) -> None:
    """The model, loss and data `_target_`s import (the trust list was checked by name); a
    LightningModule without a data config brings its own train_dataloader."""
    model = spec.model["_target_"]
    _importable("model._target_", model)
    if spec.engine.name == "lightning":
        _check_lightning_module(spec.distributed, model)
    if isinstance(spec.loss, dict):
        _importable("loss._target_", spec.loss["_target_"])
    if spec.data:
        _importable("data._target_", spec.data["_target_"])
    elif not _brings_own_data(model):  # `~data`: only a LightningModule with its own loader
        raise ConfigError(
            "data",
            None,
            "a Dataset or LightningDataModule config with _target_, or a "
            f"LightningModule with its own train_dataloader (not {model})",
        )


def _importable(key: str, target: str) -> None:
    """A trusted `_target_` imports (not called); ConfigError if it does not."""
    from hydra.utils import get_object

    # get_object logs its failure at ERROR before raising: quiet that, the ConfigError says it.
    hydra_log = logging.getLogger("hydra.utils")
    was_disabled, hydra_log.disabled = hydra_log.disabled, True
    try:
        get_object(target)
    except Exception as exc:  # ImportError, AttributeError, or the module failing on import
        raise ConfigError(key, target, f"an importable class or function ({exc})") from None
    finally:
        hydra_log.disabled = was_disabled


def _lightning_module(target: str) -> Any:
    """The LightningModule class `target` names, or None (lightning imported only if the target's
    module already did: then it is one)."""
    from hydra.utils import get_object

    cls = get_object(target)
    if not isinstance(cls, type) or "lightning" not in sys.modules:
        return None
    import lightning.pytorch as pl

    return cls if issubclass(cls, pl.LightningModule) else None


def _brings_own_data(model_target: str) -> bool:
    """Whether `model._target_` is a LightningModule overriding Lightning's train_dataloader."""
    cls = _lightning_module(model_target)
    if cls is None:
        return False
    import lightning.pytorch as pl

    return getattr(cls, "train_dataloader", None) is not pl.LightningModule.train_dataloader


# The FSDP2 knobs gpuopt applies in its own configure_model (gpuopt.engines.lightning.strategy),
# which a user's LightningModule replaces with its own.
LIGHTNING_MODULE_FSDP2_KEYS = (
    "reshard_after_forward",
    "param_dtype",
    "reduce_dtype",
    "shard_modules",
    "checkpoint_modules",
)


def _check_lightning_module(dist: DistributedConf, model_target: str) -> None:
    """A user's own LightningModule under `distributed=fsdp2`: what Lightning's
    ModelParallelStrategy needs of it (`check_lightning_module_sharding`)."""
    cls = _lightning_module(model_target)
    if cls is not None:
        import lightning.pytorch as pl

        own = getattr(cls, "configure_model", None) is not pl.LightningModule.configure_model
        check_lightning_module_sharding(dist, model_target, own)


def check_lightning_module_sharding(
    dist: DistributedConf, module: str, own_configure_model: bool
) -> None:
    """`distributed=fsdp2` under engine=lightning for the user's own LightningModule `module`
    (Lightning's ModelParallelStrategy): the module shards itself in its configure_model, so it
    must have one, and gpuopt's FSDP2 knobs, which only gpuopt's configure_model applies, must keep
    their defaults."""
    if dist.kind != "fsdp2":
        return
    if not own_configure_model:
        raise ConfigError(
            "distributed.kind",
            dist.kind,
            f"none | ddp for {module} (fsdp2 under engine=lightning: a LightningModule applies "
            "fully_shard in its own configure_model, or a plain nn.Module that gpuopt shards)",
        )
    defaults = DistributedConf()
    for key in LIGHTNING_MODULE_FSDP2_KEYS:
        value = getattr(dist, key)
        if value != getattr(defaults, key):
            raise ConfigError(
                f"distributed.{key}",
                value,
                f"{getattr(defaults, key)} for {module} (its own configure_model shards it)",
            )
