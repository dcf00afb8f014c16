"""The engine registry: `load_spec(cfg)` turns a composed config into the one validated TrialSpec
(the torch-free checks, then importing its `_target_`s), `run_trial(spec)` measures it with the
engine `engine.name` names.

- `native` (gpuopt.engines.native): gpuopt's own training loop.
- `lightning` (gpuopt.engines.lightning.engine): the trial runs through `lightning.Trainer`.

Each engine is a module with `measure(trial, process_t0)`; what engines share lives in the private
modules of this package (`_build`, `_batches`, `_loss`, `_step`, `_window`, `_epoch`, `_ceiling`,
`_guard`, and `_lifecycle`: the route of one trial, its failure handling and clean-up), and engines
never import each other. The registry is the only way in: a trial through `run_trial`, and the
sweeper's probing processes (gpuopt.processes.shared_windows, gpuopt.processes.memory_probe) to the entries the
native engine offers them through `engine_entry`. An engine module is imported only when chosen:
Lightning is an optional extra (`pip install "gpuopt[lightning]"`) and importing it costs seconds;
importing this module imports neither torch nor any engine (config validation in the sweeping
process uses it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuopt.core.checks import (
    Checked,
    check_values,
    spec_from_checked,
)
from gpuopt.core.distributed_checks import check_lightning_module_sharding
from gpuopt.core.errors import ConfigError
from gpuopt.core.host import usable_cpus
from gpuopt.core.spec import BUILTIN_TRUSTED_TARGETS, GpuoptConf
from gpuopt.core.workload_checks import check_target

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from omegaconf import DictConfig

    from gpuopt.core.result import TrialResult
    from gpuopt.core.spec import TrialSpec
    from gpuopt.engines._lifecycle import Measure


@dataclass(frozen=True)
class EngineEntry:
    module: str  # defines measure(trial, process_t0)
    extra: str | None = (
        None  # the optional package it needs, installed as gpuopt's extra of that name
    )


# The names match gpuopt.core.spec.ENGINES (validation's list; tests/test_architecture.py checks it).
ENGINES: dict[str, EngineEntry] = {
    "native": EngineEntry("gpuopt.engines.native"),
    "lightning": EngineEntry("gpuopt.engines.lightning.engine", extra="lightning"),
}


def load_engine(name: str) -> Measure:
    """The `measure` function of the engine called `name`, importing its module now."""
    return engine_entry(name, "measure")


def engine_entry(name: str, entry: str) -> Callable[..., Any]:
    """The function `entry` of the engine called `name`, importing its module now: its `measure`,
    or what the native engine offers the sweeper's probing processes (`open_windows`,
    `repeated_step`)."""
    try:
        module = ENGINES[name].module
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: one of {', '.join(ENGINES)}") from None
    extra = ENGINES[name].extra
    # find_spec is cheap (no import) and None when the package is absent (or masked in sys.modules).
    if extra is not None and importlib.util.find_spec(extra) is None:
        raise ModuleNotFoundError(
            f'engine={name} needs {extra}: pip install "gpuopt[{extra}]"', name=extra
        )
    return getattr(importlib.import_module(module), entry)


def run_trial(
    spec: TrialSpec,
    device: torch.device | None = None,
    inspect: Callable[[str, Any], None] | None = None,
) -> TrialResult:
    """Build and measure one configuration with the engine `spec.engine.name` names. Never raises
    for a failing workload: OOM, divergence and errors (also an engine that cannot be imported)
    come back as the result's status. `inspect(name, obj)` sees what the engine built.

    The one route of a trial: the engine measures (its windows, the profiled window) and asks
    for the numerics guard, which runs once its memory is released (gpuopt.engines._lifecycle).
    A distributed trial (`distributed.kind` ddp | fsdp2) starts its ranks here, each measuring
    through `run_rank`, and returns the job's one result (gpuopt.trial.distributed)."""
    from gpuopt.engines._lifecycle import run_measured

    if spec.distributed.kind != "none":
        from gpuopt.trial.devices import resolve_device
        from gpuopt.trial.distributed import launch_ranks

        device = device if device is not None else resolve_device(spec.device.type)
        return launch_ranks(spec, device, run_rank)
    return run_measured(spec, _engine_or_failure(spec.engine.name), device, inspect)


def stored_spec(spec: TrialSpec) -> dict[str, Any]:
    """The spec as a trial result stores it (its `config`): what the sweeper compares."""
    from gpuopt.engines._lifecycle import spec_to_dict

    return spec_to_dict(spec)


def run_rank(spec: TrialSpec, device: torch.device) -> TrialResult:
    """One rank of a distributed trial, in the process group gpuopt.trial.distributed set up:
    the engine measures its share (it wraps the model, aligns the window with the other ranks)."""
    from gpuopt.engines._lifecycle import run_measured

    return run_measured(spec, _engine_or_failure(spec.engine.name), device)


def _engine_or_failure(name: str) -> Measure:
    """The engine's `measure`, or, when it cannot be loaded (an unknown name, a missing extra), a
    stand-in raising why: run_measured makes that an error result like any other."""
    try:
        return load_engine(name)
    except Exception as exc:
        return functools.partial(_raise, exc)


def _raise(exc: Exception, trial: Any, process_t0: float) -> None:
    raise exc


def brings_own_data(model_target: str) -> bool:
    """Whether `model._target_` is a LightningModule class with its own train_dataloader (then the
    data group may be left out). Imports lightning only if the target's module already did."""
    from hydra.utils import get_object

    target = get_object(model_target)
    if not isinstance(target, type) or "lightning" not in sys.modules:
        return False
    import lightning.pytorch as pl

    from gpuopt.engines.lightning.engine import owns_train_dataloader

    return issubclass(target, pl.LightningModule) and owns_train_dataloader(target)


def _check_lightning_module(typed: GpuoptConf, model_target: str) -> None:
    """A user's own LightningModule under `distributed=fsdp2`: what Lightning's
    ModelParallelStrategy needs of it (gpuopt.core.distributed_checks). Imports lightning only if
    the target's module already did (then it is one)."""
    if typed.distributed.kind != "fsdp2":
        return
    from hydra.utils import get_object

    target = get_object(model_target)
    if "lightning" not in sys.modules:
        return
    import lightning.pytorch as pl

    if not (isinstance(target, type) and issubclass(target, pl.LightningModule)):
        return
    own = getattr(target, "configure_model", None) is not pl.LightningModule.configure_model
    check_lightning_module_sharding(typed.distributed, model_target, own)


def load_spec(cfg: DictConfig, checked: Checked | None = None) -> TrialSpec:
    """Check a composed config and return the typed `TrialSpec`, or raise `ConfigError`.

    `gpuopt.core.checks`' torch-free checks, then that the `_target_`s import (the user's modules,
    hence torch): the one validation a trial's process runs. `checked`: the values this process
    already checked (`check_values` on the same cfg, before any torch import), not checked again.
    """
    if checked is None:
        checked = check_values(cfg, usable_cpus())
    data = _check_workload_imports(checked.model, checked.data, checked.typed)
    return spec_from_checked(checked, data)


def _check_workload_imports(
    model: dict[str, Any], data: dict[str, Any] | None, typed: GpuoptConf
) -> dict[str, Any]:
    """The `_target_`s import (this imports the user's module, hence torch); returns the data."""
    trusted = BUILTIN_TRUSTED_TARGETS + tuple(typed.trust)
    check_target("model._target_", model["_target_"], trusted)
    if typed.engine.name == "lightning":
        _check_lightning_module(typed, model["_target_"])
    if isinstance(typed.loss, dict):
        check_target("loss._target_", typed.loss["_target_"], trusted)
    if data is not None:
        check_target("data._target_", data["_target_"], trusted)
        return data
    # A LightningModule may bring its own train_dataloader (compose with `~data`).
    if not brings_own_data(model["_target_"]):
        raise ConfigError(
            "data",
            data,
            "a Dataset or LightningDataModule config with _target_, or a "
            f"LightningModule with its own train_dataloader (not {model['_target_']})",
        )
    return {}
