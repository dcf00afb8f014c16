"""Write a trial's configuration as a Hydra experiment config that reproduces it.

The trial ran as the primary config plus a list of overrides. The export turns those overrides
into `experiment/best.yaml` (`# @package _global_`): config-group choices become
`defaults: - override /group: option`, other keys nested values, so
`python -m gpuopt.run --config-dir <sweep_dir> +experiment=best` composes the same config.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gpuopt.sweeper.space import parser


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
        override = parser().parse_override(line)
        key = override.key_or_group
        if (
            override.is_delete()
            or override.is_sweep_override()
            or key.startswith("hydra.")
            or key == "hydra"
        ):
            skipped.append(line)
            continue
        if override.package is not None:
            skipped.append(line)  # group@package overrides: rare; not expressible simply
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


def stock_results(
    directions: Sequence[str], best_trials: Sequence[Any], extra: dict[str, Any]
) -> dict[str, Any]:
    """optimization_results.yaml in hydra-optuna-sweeper's shape, plus gpuopt keys."""
    if len(directions) < 2:
        best = best_trials[0] if best_trials else None
        out: dict[str, Any] = {
            "name": "optuna",
            "best_params": dict(best.params) if best else {},
            "best_value": best.value if best else None,
        }
    else:
        out = {
            "name": "optuna",
            "solutions": [
                {"params": dict(t.params), "values": list(t.values)} for t in best_trials
            ],
        }
    out.update(extra)
    return out
