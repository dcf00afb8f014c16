"""Specs of trials whose model (and data) are the user Lightning classes of
tests/helpers/lightning_models.py (tests/test_lightning.py, tests/test_lightning_distributed_profile.py)."""

from __future__ import annotations

from typing import Any

from gpuopt.trial.prepare import load_spec
from tests.conftest import TINY_TRIAL

HELPERS = "tests.helpers.lightning_models"


def user_spec(
    compose_cfg: Any, model: dict[str, Any], *overrides: str, data: dict[str, Any] | None = None
):
    """A spec whose model (and data) are user Lightning classes from tests/helpers."""
    cfg = compose_cfg(
        "engine=lightning",
        *TINY_TRIAL[:5],
        "device=cpu",
        f"trust=[{HELPERS}.*]",
        "~data",
        *overrides,
    )
    cfg.model = model
    if data is not None:
        cfg.data = data
    return load_spec(cfg)
