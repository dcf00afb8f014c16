"""The torch side of the validation route: `prepare_trial(cfg)` turns a composed config into the
one checked TrialSpec and its device, or raises one `ConfigError`, before anything is built.

The order matters: the torch-free checks first (a bad value fails before seconds of imports),
then the allocator settings (torch reads them when first imported), then the `_target_` imports
(hence torch), then the device against this process's facts.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    """The trial's one validation and its device; raises ConfigError. `run_dir`: a single run's
    `hydra.run.dir` must be writable too. `allocator=False`: the sweeper's measuring processes
    measure in the environment they were started in."""
    spec = check_composed(cfg, run_dir=run_dir)
    warnings = (
        apply_allocator_env(spec.cache.cuda_alloc_conf, spec.cache.cpu_thp) if allocator else []
    )
    _import_targets(spec)
    device, device_warnings = trial_device(spec)
    return PreparedTrial(spec, device, [*warnings, *device_warnings])


def load_spec(cfg: DictConfig) -> TrialSpec:
    """The checked TrialSpec of a composed config, its targets imported, without a device (for
    tests and scripts)."""
    spec = check_composed(cfg)
    _import_targets(spec)
    return spec


def _import_targets(spec: TrialSpec) -> None:
    """The model, loss and data `_target_`s import; a LightningModule without a data config
    brings its own train_dataloader."""
    model = spec.model["_target_"]
    _importable("model._target_", model)
    if spec.engine.name == "lightning":
        own = _overrides(model, "configure_model")
        if own is not None:
            check_lightning_module_sharding(spec.distributed, model, own)
    if isinstance(spec.loss, dict):
        _importable("loss._target_", spec.loss["_target_"])
    if spec.data:
        _importable("data._target_", spec.data["_target_"])
    elif not _overrides(model, "train_dataloader"):  # `~data`: a LightningModule's own loader
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


def _overrides(target: str, method: str) -> bool | None:
    """Whether the LightningModule class `target` names overrides `method`; None when it is no
    LightningModule (lightning is imported only where the target's module already did)."""
    from hydra.utils import get_object

    cls = get_object(target)
    if not isinstance(cls, type) or "lightning" not in sys.modules:
        return None
    import lightning.pytorch as pl

    if not issubclass(cls, pl.LightningModule):
        return None
    return getattr(cls, method, None) is not getattr(pl.LightningModule, method)


# The FSDP2 knobs gpuopt applies in its own configure_model (gpuopt.engines.lightning.engine, BuiltinModule),
# which a user's LightningModule replaces with its own.
LIGHTNING_MODULE_FSDP2_KEYS = (
    "reshard_after_forward",
    "param_dtype",
    "reduce_dtype",
    "shard_modules",
    "checkpoint_modules",
)


def check_lightning_module_sharding(
    dist: DistributedConf, module: str, own_configure_model: bool
) -> None:
    """`distributed=fsdp2` under engine=lightning for the user's own LightningModule: it shards
    itself in its configure_model, so it must have one, and gpuopt's FSDP2 knobs, which only
    gpuopt's configure_model applies, must keep their defaults."""
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
