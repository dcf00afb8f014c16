"""--export-best: the best trial's overrides as a Hydra experiment config, verified by composing it.

The conversion is gpuopt.study.experiment's (shared with the sweep's best.yaml); this module adds
the packaged conf/'s groups and the check that the written file composes to the trial's config.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from gpuopt.study.experiment import overrides_to_experiment

CONF_PACKAGE = "gpuopt.conf"


@functools.cache
def conf_groups() -> frozenset[str]:
    """The folders of the packaged conf/: a dotless key naming one is a config group."""
    return frozenset(
        entry.name
        for entry in resources.files(CONF_PACKAGE).iterdir()
        if entry.is_dir() and not entry.name.startswith(("_", "."))
    )


def experiment_text(overrides: Sequence[str]) -> str:
    """The experiment config as YAML, for showing in the report (no header)."""
    body, _ = overrides_to_experiment(overrides, conf_groups())
    return "# @package _global_\n" + (OmegaConf.to_yaml(OmegaConf.create(body)) if body else "{}\n")


def compose_experiment(yaml_text: str, name: str) -> dict[str, Any]:
    """The resolved config (no `hydra`) of `+experiment=<this text>`, as `python -m gpuopt.run`
    would compose it; from a temporary folder, so the check does not depend on where the file is."""
    from hydra import compose, initialize_config_search_path

    from gpuopt.core.spec import register_schemas

    register_schemas()  # conf/config.yaml starts from the `gpuopt_schema` structured config
    with tempfile.TemporaryDirectory(prefix="gpuopt-export-") as tmp:
        folder = Path(tmp) / "experiment"
        folder.mkdir()
        (folder / f"{name}.yaml").write_text(yaml_text)
        with initialize_config_search_path([f"pkg://{CONF_PACKAGE}", f"file://{tmp}"]):
            cfg = compose(config_name="config", overrides=[f"+experiment={name}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    return resolved  # type: ignore[return-value]
