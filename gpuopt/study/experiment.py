"""A trial's overrides as a Hydra experiment config that reproduces it (`# @package _global_`,
config-group choices as `override /group: option`): the sweep's `experiment/best.yaml` and the
report's `--export-best`; and `override_diff`, the change to apply that both answers name.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# How gpuopt measures and guards a trial, never what it trains: a sweep fixes them for its trials,
# so no answer hands them back (`+experiment=best` measures with the user's own settings).
MEASUREMENT_GROUPS = ("measure", "guard")


def is_measurement_key(key: str) -> bool:
    """`measure`, `guard` or a key under them (a `+`/`++`/`~` prefix ignored)."""
    return key.lstrip("+~").split(".", 1)[0].split("/", 1)[0] in MEASUREMENT_GROUPS


@functools.cache
def override_parser() -> Any:
    """Hydra's override parser (built once: building it costs milliseconds per call)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _override_map(overrides: list[str]) -> dict[str, tuple[str, str]]:
    """key (no +/++ prefix) -> (normalized value, the override as written), measurement keys out."""
    result: dict[str, tuple[str, str]] = {}
    for override, line in zip(
        override_parser().parse_overrides(overrides), overrides, strict=False
    ):
        key = override.key_or_group + (f"@{override.package}" if override.package else "")
        value = "~" if override.is_delete() else override.get_value_element_as_str()
        if not is_measurement_key(key):
            result[key] = (value, line)
    return result


def override_diff(baseline: list[str], best: list[str]) -> tuple[list[str], list[str]]:
    """(best overrides that differ from the baseline's, baseline overrides the best one drops),
    measurement keys left out."""
    base_map, best_map = _override_map(baseline), _override_map(best)
    changed = [
        line for key, (value, line) in best_map.items() if base_map.get(key, (None,))[0] != value
    ]
    dropped = [line for key, (_, line) in base_map.items() if key not in best_map]
    return changed, dropped


def overrides_to_experiment(
    overrides: Sequence[str], groups: Iterable[str]
) -> tuple[dict[str, Any], list[str]]:
    """(experiment config as a dict, overrides that cannot be expressed and were skipped)."""
    from omegaconf import OmegaConf

    group_names = {str(g) for g in groups}
    defaults: list[dict[str, Any]] = []
    values = OmegaConf.create({})
    skipped: list[str] = []
    for line in overrides:
        override = override_parser().parse_override(line)
        key = override.key_or_group
        if (
            override.is_delete()
            or override.is_sweep_override()
            or key.split(".", 1)[0] == "hydra"
            or override.package is not None  # group@package: rare; not expressible simply
        ):
            skipped.append(line)
            continue
        if key in group_names:
            entry = f"/{key}" if override.is_add() else f"override /{key}"
            defaults.append({entry: override.value()})
            continue
        OmegaConf.update(values, key, override.value(), merge=False, force_add=True)
    body: dict[str, Any] = {}
    if defaults:
        body["defaults"] = [*defaults, "_self_"]
    body.update(OmegaConf.to_container(values))  # type: ignore[arg-type]
    return body, skipped


def write_experiment(path: Path, body: dict[str, Any], header: Sequence[str]) -> Path:
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(OmegaConf.create(body)) if body else "{}\n"
    lines = ["# @package _global_", *[f"# {h}" for h in header], text]
    path.write_text("\n".join(lines))
    return path
