"""The app being swept: gpuopt's own task (`hydra.sweeper.gpuopt_task: true`, set by gpuopt's
conf/config.yaml) or any other Hydra app on the stock hydra-optuna-sweeper contract.

Another app keeps the stock meaning of every key (in-memory `storage: null`, `direction`, values
named value / value_i); gpuopt's task gets its metrics, a derived study name and its checks."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf

from gpuopt.core import knobs
from gpuopt.core.errors import SweepConfigError
from gpuopt.core.metrics import goals
from gpuopt.study import storage as storage_mod
from gpuopt.study.rules import plain_labels, plain_names
from gpuopt.sweeper import machine
from gpuopt.sweeper.objectives import (
    on_this_device,
    parse_directions,
    resolve_objectives,
    utilization_note,
)
from gpuopt.sweeper.open_study import SweepIdentity, space_digest
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.sweeper.space import SearchSpace

log = logging.getLogger("gpuopt.sweeper")


def objectives(options: SweeperOptions, direction: Any) -> tuple[list[str], list[str]]:
    """gpuopt's metrics for its own task (or when `objectives` names them); for another app
    the stock sweeper's: its `direction` (default minimize), values labelled value/value_i."""
    if options.objectives is not None or options.gpuopt_task:
        names, directions = resolve_objectives(options.objectives, direction)
        own = [n for n in names if n not in goals()]
        if own and options.gpuopt_task:  # gpuopt's own task returns only gpuopt's metrics
            raise SweepConfigError(
                "hydra.sweeper.objectives",
                own[0],
                f"gpuopt's metric names ({', '.join(goals())})",
            )
        return names, directions
    directions = parse_directions(direction) or ["minimize"]  # the stock default
    return plain_labels(len(directions)), directions


def device_objectives(
    options: SweeperOptions, names: list[str], facts: Mapping[str, Any] | None
) -> list[str]:
    """gpuopt's default objectives on the probed device (`sm_active` for `utilization` where
    the GPU has GPM), said in one line; objectives the user named, and another app's, stay."""
    if options.objectives is not None or not options.gpuopt_task:
        return names
    names = on_this_device(names, facts)
    note = utilization_note(names, facts)
    if note:
        log.info(note)
    return names


def study_metric_names(study: optuna.Study, names: list[str]) -> list[str]:
    """The study's own metric names (Study.set_metric_names) for an app's plain values."""
    if not plain_names(names):
        return names
    stored = study.metric_names
    return list(stored) if stored and len(stored) == len(names) else names


def study_name(
    options: SweeperOptions,
    given: str | None,
    config: DictConfig,
    space: SearchSpace,
    hw_id: str,
) -> str | None:
    """As given; else, for gpuopt's own task, the workload, the preset, a digest of the search
    space and the hardware (a changed space is a new study); else Optuna's own (None)."""
    if given or not options.gpuopt_task:
        return given
    search = "-".join(p for p in (choice(config, "search"), space_digest(space.distributions)) if p)
    workload = choice(config, "model") or str(config.hydra.job.name)
    return machine.default_study_name(workload, search or None, hw_id)


def check_values(options: SweeperOptions, config: DictConfig) -> None:
    """gpuopt's own task: the values no machine fact decides, checked before the env probe runs
    (a typo's one-line error comes at once, not after the probe's ~2.5 s torch import)."""
    if options.gpuopt_task:
        from gpuopt.core.checks import check_composed

        check_composed(config, facts=None)


def check_task(
    options: SweeperOptions, config: DictConfig, probe: machine.EnvProbe
) -> machine.EnvProbe:
    """gpuopt's own task: the composed config checked once before the study (gpuopt.core.checks),
    its device against `python -m gpuopt.env --json` of the trials' machine; one line, exit 2."""
    if not options.gpuopt_task:
        return probe
    if not probe.data:
        probe = machine.probe_env(options.env_timeout_s)
    from gpuopt.core.checks import check_composed

    check_composed(config, facts=probe.data or None)
    if not probe.data:
        log.warning("device checks skipped: %s", probe.error)
    return probe


def choice(config: DictConfig, group: str) -> str | None:
    """The option chosen for a config group (hydra.runtime.choices), or None."""
    choices = config.hydra.runtime.choices
    value = choices.get(group) if choices is not None else None
    return str(value) if value is not None else None


def configured_device(config: DictConfig) -> str | None:
    value = OmegaConf.select(config, "device.type", default=None)
    return str(value) if value is not None else None


def command(config: DictConfig) -> str:
    """How the user started this app: `python -m pkg.mod` or `python script.py` as typed."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return f"python -m {spec.name.removesuffix('.__main__')}"
    script = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None
    return f"python {script or str(config.hydra.job.name) + '.py'}"


def sweep_groups(config: DictConfig, config_loader: Any) -> list[str]:
    """Config groups whose chosen option configures the sweep itself (like
    lightning-hydra-template's `hparams_search`): an exported best config leaves them out."""
    found = []
    for group, option in (config.hydra.runtime.choices or {}).items():
        if option is None or str(group).startswith("hydra/"):
            continue
        node = _load_option(config_loader, f"{group}/{option}")
        hydra_node = node.get("hydra") if node is not None else None
        if isinstance(hydra_node, DictConfig) and ("sweeper" in hydra_node or "mode" in hydra_node):
            found.append(str(group))
    return found


def _load_option(loader: Any, path: str) -> DictConfig | None:
    """A group option's own config, through Hydra's public ConfigSource API (None if unreadable)."""
    for source in loader.get_sources():
        try:
            if source.is_config(path):
                node = source.load_config(path).config
                return node if isinstance(node, DictConfig) else None
        except Exception:
            continue
    return None


def probe_env(options: SweeperOptions, params: Mapping[str, Any] | None) -> machine.EnvProbe:
    """`python -m gpuopt.env --json` once, for device-aware presets; empty when nothing needs it
    (the probe imports torch, ~3.5 s of an app's sweep of its own keys)."""
    judged = any(knobs.probed(str(k)) for k in params or {})
    if not options.device_aware or not (judged or options.device_params):
        return machine.EnvProbe()
    probe = machine.probe_env(options.env_timeout_s)
    if probe.error:
        log.warning("device-aware presets off: %s", probe.error)
    return probe


def check_sampler(sampler: Any, directions: list[str]) -> None:
    """CMA-ES is single-objective: a clear config error instead of Optuna's at the first tell."""
    if len(directions) > 1 and isinstance(sampler, optuna.samplers.CmaEsSampler):
        raise SweepConfigError(
            "hydra/sweeper/sampler",
            "cmaes",
            f"a multi-objective sampler for {len(directions)} objectives (tpe, nsgaii, gp, "
            "random, qmc), or one objective: hydra.sweeper.objectives=[throughput]",
        )


def sweep_identity(
    config: DictConfig,
    config_loader: Any,
    options: SweeperOptions,
    study: optuna.Study,
    url: str | None,
    names: list[str],
    directions: list[str],
) -> SweepIdentity:
    """What the outputs say about this sweep: where, which names, how to reproduce it in this app."""
    choices = config.hydra.runtime.choices or {}
    return SweepIdentity(
        study_name=study.study_name,
        storage=storage_mod.display(url),
        sweep_dir=Path(str(config.hydra.sweep.dir)),
        names=names,
        directions=directions,
        app_command=command(config),
        groups=[k for k in choices if not str(k).startswith("hydra/")],
        persisted=url is not None,
        experiment_added="experiment" not in choices,
        sweep_groups=sweep_groups(config, config_loader),
        metrics_named=bool(options.objectives) or options.gpuopt_task,
    )
