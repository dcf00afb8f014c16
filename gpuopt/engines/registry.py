"""The engine registry: `run_trial(spec)` measures a checked TrialSpec with the engine
`engine.name` names; `engine_entry` gives the sweeper's probing processes what the native engine
offers them. An engine module is imported only when chosen: Lightning is an optional extra and
importing it costs seconds; importing this module imports neither torch nor any engine.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from gpuopt.core.result import TrialResult
    from gpuopt.core.spec import TrialSpec
    from gpuopt.engines._lifecycle import Measure


@dataclass(frozen=True)
class EngineEntry:
    module: str  # defines measure(trial, process_t0)
    extra: str | None = None  # the optional package it needs (gpuopt's extra of that name)


# The names match gpuopt.core.spec.ENGINES (validation's list; tests/test_architecture.py checks it).
ENGINES: dict[str, EngineEntry] = {
    "native": EngineEntry("gpuopt.engines.native"),
    "lightning": EngineEntry("gpuopt.engines.lightning.engine", extra="lightning"),
}


def load_engine(name: str) -> Measure:
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
    come back as the result's status. `inspect(name, obj)` sees what the engine built. A
    distributed trial starts its ranks here, each measuring through `run_rank`."""
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
    """One rank of a distributed trial, in the process group gpuopt.trial.distributed set up."""
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
