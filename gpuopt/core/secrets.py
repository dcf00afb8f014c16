"""Keep storage passwords out of logs, user attributes, reports and exported configs."""

from __future__ import annotations

import re
from typing import Any

# user:password@ in any URL-like string (also inside longer text such as an exception message).
_CREDENTIALS = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@\s]*)@"
)


def mask_secrets(text: str) -> str:
    """Replace the password of every `scheme://user:password@host` in `text` with `***`."""
    return _CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


def mask_config_secrets(config: Any) -> None:
    """Mask storage passwords in a composed config's `hydra` node, in place.

    Hydra copies that node into every trial's .hydra/hydra.yaml, overrides.yaml and multirun.yaml.
    Interpolations such as ${oc.env:GPUOPT_STORAGE} are kept: they hold no secret, and resolving
    them here would write the secret out.
    """
    from omegaconf import open_dict, read_write

    hydra_cfg = config.get("hydra")
    if hydra_cfg is None:
        return
    with read_write(config), read_write(hydra_cfg), open_dict(hydra_cfg):
        _mask_node(hydra_cfg)


def _mask_node(node: Any) -> None:
    """Mask every literal string under an OmegaConf container (public OmegaConf API only)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            _mask_node(value)
        elif isinstance(value, str):
            masked = mask_secrets(value)
            if masked != value:
                node[key] = masked


def masked_singleton_state(state: dict[str, Any]) -> dict[str, Any]:
    """Hydra's `Singleton.get_state()` (a deep copy) with the storage passwords masked in its
    HydraConfig, which holds the sweep's `hydra` node (hydra.sweeper.storage and the command-line
    overrides): the state is pickled into every job's `.submitit/*_submitted.pkl`. The trial never
    opens the study, so it needs no password; the sweeping process keeps the real URL in memory.
    """
    from hydra.core.hydra_config import HydraConfig

    holder = state.get("instances", {}).get(HydraConfig)
    cfg = getattr(holder, "cfg", None)
    if cfg is not None:
        mask_config_secrets(cfg)
    return state
