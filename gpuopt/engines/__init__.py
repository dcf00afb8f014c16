"""Training engines, found by name (`engine.name`): `run_trial(spec)` measures a TrialSpec with one.

- `native` (gpuopt.engines.native): gpuopt's own training loop.
- `lightning` (gpuopt.engines.lightning): the trial runs through `lightning.Trainer`.

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

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from gpuopt.config import TrialSpec
    from gpuopt.engines._common import Measure
    from gpuopt.result import TrialResult


@dataclass(frozen=True)
class EngineEntry:
    module: str  # defines measure(trial, process_t0)
    extra: str | None = (
        None  # the optional package it needs, installed as gpuopt's extra of that name
    )


# The names match gpuopt.config.ENGINES (validation's list; tests/test_architecture.py checks it).
ENGINES: dict[str, EngineEntry] = {
    "native": EngineEntry("gpuopt.engines.native"),
    "lightning": EngineEntry("gpuopt.engines.lightning", extra="lightning"),
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
    from gpuopt.numerics import guard_result

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

    from gpuopt.engines.lightning import owns_train_dataloader

    return issubclass(target, pl.LightningModule) and owns_train_dataloader(target)
