"""Keep secrets out of logs, user attributes, reports, exported configs and job pickles.

A secret, in any text: the password of `scheme://user:password@host` (also percent-encoded as a
whole), and the value of a credential parameter `name=value` (a URL's query, libpq's conninfo, an
override such as `+db.password=...`; quoted or not, percent-encoded or not). A bare `key` counts
only when its value is an opaque token (20+ letters and digits, both): `key=train` names a thing.
The value becomes `***`; scheme, user, host and database stay, so a masked URL still says where.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

# user:password@ in any URL-like string (also inside longer text such as an exception message).
_CREDENTIALS = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@\s]*)@"
)
# The same, percent-encoded as a whole: scheme%3A%2F%2Fuser%3Apassword%40
_ENCODED_CREDENTIALS = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*%3A%2F%2F)(?P<user>(?:(?!%3A|%2F|%40)[^:/@\s&])*)%3A"
    r"(?P<password>(?:(?!%40)[^@\s&])*)%40",
    re.IGNORECASE,
)
# name=value (quoted or not) where name is a credential's, after the start, whitespace or one of
# ? & ; . , ( + ~ (a URL's query, libpq's conninfo, a Hydra override)
_SECRET_NAME = (
    r"[A-Za-z0-9_\-]*(?:password|passwd|secret|token|api[_\-]?key|access[_\-]key|secret[_\-]key"
    r"|private[_\-]key|signature)|pwd|pass|sig|credentials?|auth|key"
)
_PARAM = re.compile(
    rf"(?:^|(?<=[?&;.,(\s+~]))(?P<name>{_SECRET_NAME})(?P<eq>\s*=\s*)"
    r"(?P<value>\*\*\*(?=[:\s]|$)|'[^']*'|\"[^\"]*\"|[^&#\s'\",;)]*)",  # masked already: kept
    re.IGNORECASE,
)
# the same in a percent-encoded URL (a URL inside another URL's query): %3F or %26, name%3Dvalue
_ENCODED_PARAM = re.compile(
    rf"(?<=%3F|%26|%3f)(?P<name>{_SECRET_NAME})(?P<eq>%3D)(?P<value>(?:(?!%26)[^&#\s'\",;)])*)",
    re.IGNORECASE,
)
# a bare `key` is a credential only when its value is an opaque token (an API key)
_TOKEN_LIKE = re.compile(r"(?=.*[A-Za-z])(?=.*[0-9])[A-Za-z0-9_\-]{20,}")


def _mask_param(match: re.Match[str]) -> str:
    value = match["value"]
    bare = value.strip("'\"")
    if not bare or bare == MASK:
        return match[0]
    if match["name"].lower() == "key" and not _TOKEN_LIKE.fullmatch(bare):
        return match[0]
    quote = value[0] if value[0] in "'\"" else ""
    return f"{match['name']}{match['eq']}{quote}{MASK}{quote}"


def mask_secrets(text: str) -> str:
    """`text` with every secret in it (module docstring) replaced with `***`."""
    text = _CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = _ENCODED_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}%3A{MASK}%40", text)
    text = _ENCODED_PARAM.sub(_mask_param, text)
    return _PARAM.sub(_mask_param, text)


def mask_config_secrets(config: Any) -> None:
    """Mask the secrets in a composed config's `hydra` node in place, before any job is submitted
    (Hydra copies it into every trial's .hydra/ files and pickles). A secret in
    `hydra.job.env_set` reaches the trial through the environment; interpolations are kept
    (resolving them here would write the secret out)."""
    from omegaconf import open_dict, read_write

    hydra_cfg = config.get("hydra")
    if hydra_cfg is None:
        return
    with read_write(config), read_write(hydra_cfg), open_dict(hydra_cfg):
        _env_set_to_environment(hydra_cfg)
        _mask_node(hydra_cfg)


def _env_set_to_environment(hydra_cfg: Any) -> None:
    """`hydra.job.env_set` entries that hold a secret move to this process's environment, which
    every trial process inherits (sbatch exports it too): a masked value left in env_set would
    overwrite the real one in the trial."""
    import os

    from omegaconf import DictConfig, OmegaConf

    env_set = OmegaConf.select(hydra_cfg, "job.env_set", default=None)
    if not isinstance(env_set, DictConfig):
        return
    moved = []
    for key in list(env_set.keys()):
        if OmegaConf.is_missing(env_set, key):
            continue
        value = env_set[key]  # an interpolation resolved: Hydra would write it resolved too
        pair = f"{key}={value}"
        if isinstance(value, str) and mask_secrets(pair) != pair:
            os.environ[str(key)] = value
            del env_set[key]
            moved.append(str(key))
    overrides = OmegaConf.select(hydra_cfg, "overrides.hydra", default=None)
    if moved and overrides is not None:
        hydra_cfg.overrides.hydra = _without_env_set(list(overrides), moved)


def _without_env_set(overrides: list[str], keys: list[str]) -> list[str]:
    """Hydra's own overrides (every job is composed again from them) without those setting the
    moved keys; a key a config file sets is deleted (`~`), as a `+` override adds only new keys."""
    deletes = []
    for key in keys:
        name = f"hydra.job.env_set.{key}"
        mine = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == name]
        if not any(o.startswith("+") for o in mine):
            deletes.append(f"~{name}")
        overrides = [o for o in overrides if o not in mine]
    return overrides + deletes


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
    """Hydra's `Singleton.get_state()` (a deep copy) with the secrets masked in its HydraConfig:
    it is pickled into every job's `.submitit/*_submitted.pkl`, and a trial never opens the study."""
    from hydra.core.hydra_config import HydraConfig

    holder = state.get("instances", {}).get(HydraConfig)
    cfg = getattr(holder, "cfg", None)
    if cfg is not None:
        mask_config_secrets(cfg)
    return state
