"""The engine registry: `load_spec(cfg)` turns a composed config into the one validated TrialSpec
(the torch-free checks, then importing its `_target_`s), `run_trial(spec)` measures it with the
engine `engine.name` names.

- `native` (gpuopt.engines.native): gpuopt's own training loop.
- `lightning` (gpuopt.engines.lightning.engine): the trial runs through `lightning.Trainer`.

Each engine is a module with `measure(trial, process_t0)`; what engines share (building, failure
classification, monitors, the compute ceiling, the window's metrics) is in `gpuopt.engines._common`,
and engines never import each other. An engine module is imported only when chosen: Lightning is
an optional extra (`pip install "gpuopt[lightning]"`) and importing it costs seconds; importing this
package imports neither torch nor any engine (config validation in the sweeping process uses it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuopt.core.checks import (
    check_target,
    check_values,
    spec_from_checked,
)
from gpuopt.core.errors import ConfigError
from gpuopt.core.host import usable_cpus
from gpuopt.core.spec import BUILTIN_TRUSTED_TARGETS, GpuoptConf

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from omegaconf import DictConfig

    from gpuopt.core.result import TrialResult
    from gpuopt.core.spec import TrialSpec
    from gpuopt.engines._common import Measure


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
    try:
        entry = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: one of {', '.join(ENGINES)}") from None
    # find_spec is cheap (no import) and None when the package is absent (or masked in sys.modules).
    if entry.extra is not None and importlib.util.find_spec(entry.extra) is None:
        raise ModuleNotFoundError(
            f'engine={name} needs {entry.extra}: pip install "gpuopt[{entry.extra}]"',
            name=entry.extra,
        )
    return importlib.import_module(entry.module).measure


def run_trial(
    spec: TrialSpec,
    device: torch.device | None = None,
    inspect: Callable[[str, Any], None] | None = None,
) -> TrialResult:
    """Build and measure one configuration with the engine `spec.engine.name` names. Never raises
    for a failing workload: OOM, divergence and errors (also an engine that cannot be imported)
    come back as the result's status. `inspect(name, obj)` sees what the engine built."""
    from gpuopt.engines._common import run_measured
    from gpuopt.trial.numerics import guard_result

    result = run_measured(spec, lambda: load_engine(spec.engine.name), device, inspect)
    return guard_result(spec, device, result)  # outside the window, the trial's memory released


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


def load_spec(cfg: DictConfig) -> TrialSpec:
    """Check a composed config and return the typed `TrialSpec`, or raise `ConfigError`.

    `gpuopt.core.checks`' torch-free checks, then that the `_target_`s import (the user's modules,
    hence torch): the one validation a trial's process runs.
    """
    checked = check_values(cfg, usable_cpus())
    data = _check_workload_imports(checked.model, checked.data, checked.typed)
    return spec_from_checked(checked, data)


def _check_workload_imports(
    model: dict[str, Any], data: dict[str, Any] | None, typed: GpuoptConf
) -> dict[str, Any]:
    """The `_target_`s import (this imports the user's module, hence torch); returns the data."""
    trusted = BUILTIN_TRUSTED_TARGETS + tuple(typed.trust)
    check_target("model._target_", model["_target_"], trusted)
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
