"""A trial's stored resolved config (the user attr `ATTR_CONFIG`), as is and flattened."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuopt.study.keys import ATTR_CONFIG


def config_of(user_attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config in a trial's user attrs ({} for a task of its own, or a trial not run)."""
    config = user_attrs.get(ATTR_CONFIG)
    return config if isinstance(config, dict) else {}


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and empty dicts stay values."""
    if not isinstance(config, dict) or (prefix and not config):
        return {prefix: config}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat
