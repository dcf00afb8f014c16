"""Training engines other than gpuopt's own loop (gpuopt.trial), selected by `engine.name`.

`engine=lightning` (gpuopt.engines.lightning) runs the trial through `lightning.Trainer`. Engines are
imported only when chosen: Lightning is an optional extra (`pip install "gpuopt[lightning]"`) and
importing it costs seconds.
"""

from __future__ import annotations

import sys
from typing import Any


def brings_own_data(model_target: str) -> bool:
    """Whether `model._target_` is a LightningModule class with its own train_dataloader (then the
    data group may be left out). Imports lightning only if the target's module already did."""
    from hydra._internal.utils import _locate

    target = _locate(model_target)
    if not isinstance(target, type) or "lightning" not in sys.modules:
        return False
    import lightning.pytorch as pl

    return issubclass(target, pl.LightningModule) and owns_train_dataloader(target)


def owns_train_dataloader(module: Any) -> bool:
    """Whether a LightningModule (class or instance) overrides Lightning's train_dataloader hook."""
    import lightning.pytorch as pl

    cls = module if isinstance(module, type) else type(module)
    return getattr(cls, "train_dataloader", None) is not pl.LightningModule.train_dataloader
