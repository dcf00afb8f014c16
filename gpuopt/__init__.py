"""gpuopt: declarative, measured tuning of PyTorch training throughput.

The public Python API (README, "Tune your own training"):

- `measure_step(step, batches, ...) -> TrialResult`: your own training step on your own batches,
  measured like a built-in trial (gpuopt.engines.user_step).
- `MeasureCallback`: the same measurement inside your own `lightning.Trainer`
  (gpuopt.engines.lightning.callback; needs the `[lightning]` extra).
- `MeasureJob`: a Hydra callback (`hydra.callbacks`) that measures any Hydra app's own training
  loop with no code change (gpuopt.measure_job; torch's optimizer hooks, its DataLoader iterators).
- `HFMeasureCallback`: the same measurement of the Hugging Face `Trainer`'s loop
  (gpuopt.engines.hf_trainer; needs the `[hf]` extra).
- `run_trial(spec)`: one configuration of gpuopt's own config tree (gpuopt.engines.registry).
- `TrialResult`, `Metrics`, `Status`: what they return (gpuopt.core.result).

Attributes resolve lazily (PEP 562): `import gpuopt` imports neither torch nor Lightning, so the
sweeping process stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuopt.core.result import Metrics, Status, TrialResult
    from gpuopt.engines.hf_trainer import HFMeasureCallback
    from gpuopt.engines.lightning.callback import UserMeasureCallback as MeasureCallback
    from gpuopt.engines.registry import run_trial
    from gpuopt.engines.user_step import measure_step
    from gpuopt.measure_job import MeasureJob

__version__ = "0.1.0"

# Public name -> (module, attribute): imported on first access.
_EXPORTS: dict[str, tuple[str, str]] = {
    "measure_step": ("gpuopt.engines.user_step", "measure_step"),
    "MeasureCallback": ("gpuopt.engines.lightning.callback", "UserMeasureCallback"),
    "MeasureJob": ("gpuopt.measure_job", "MeasureJob"),
    "HFMeasureCallback": ("gpuopt.engines.hf_trainer", "HFMeasureCallback"),
    "run_trial": ("gpuopt.engines.registry", "run_trial"),
    "TrialResult": ("gpuopt.core.result", "TrialResult"),
    "Metrics": ("gpuopt.core.result", "Metrics"),
    "Status": ("gpuopt.core.result", "Status"),
}

__all__ = [
    "HFMeasureCallback",
    "MeasureCallback",
    "MeasureJob",
    "Metrics",
    "Status",
    "TrialResult",
    "measure_step",
    "run_trial",
]


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'gpuopt' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later accesses skip this hook
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
