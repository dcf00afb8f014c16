"""Opening the sweep's study: where it lives, its name, what a new one records, and the sweep's
identity as its outputs tell it (`SweepIdentity`)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from gpuopt.core.errors import ConfigError, SweepConfigError
from gpuopt.core.secrets import mask_secrets
from gpuopt.study import storage as storage_mod
from gpuopt.study.keys import STUDY_DIRECTIONS, STUDY_HARDWARE, STUDY_OBJECTIVES
from gpuopt.study.rules import plain_names
from gpuopt.sweeper import machine, record

log = logging.getLogger("gpuopt.sweeper")

MEMORY = "memory"
EXPERIMENT_GROUP = "experiment"  # where best.yaml goes: <sweep_dir>/experiment/best.yaml
URL_FORMS = (
    "an Optuna storage URL (sqlite:///path, postgresql+psycopg://user@host/db, "
    "journal:///path, null or memory: in-memory)"
)


class StorageConnectError(ConfigError):
    """A reachable-looking storage URL whose server is down or refused the login: one line in
    the server's words, exit status 2 - not "invalid sweep config" with the URL forms."""

    def __init__(self, exc: storage_mod.StorageUnreachable) -> None:
        super().__init__("hydra.sweeper.storage", str(exc), "a storage that accepts the login")
        self.args = (str(exc),)


def check_storage(storage: Any, config: Any) -> None:
    """The storage before the machine is probed (seconds): a server pinged once (nothing
    created), a SQLite file's folder checked. A refused login is the sweep's first and only line."""
    url = storage_url(storage, config, create=False)
    if url is None:
        return
    try:
        storage_mod.ping(url)
    except storage_mod.StorageUnreachable as exc:
        raise StorageConnectError(exc) from None
    except (ValueError, ImportError) as exc:
        raise _invalid_url(url, exc) from None


def _invalid_url(url: str | None, exc: BaseException) -> SweepConfigError:
    return SweepConfigError(
        "hydra.sweeper.storage",
        storage_mod.display(url),
        f"{URL_FORMS}: {mask_secrets((str(exc).strip() or type(exc).__name__).splitlines()[0])}",
    )


def storage_url(storage: Any, config: Any, create: bool = True) -> str | None:
    """`hydra.sweeper.storage` -> what storage.open_storage takes: null or "memory" -> None. A
    SQLite file's folder is created only when it is the configured output_dir (as Hydra creates run
    dirs): any other missing folder is a mistyped path."""
    from omegaconf import OmegaConf

    if storage is None or str(storage) == MEMORY:
        return None
    url = str(storage)
    if not url.startswith(SQLITE_PREFIX) or url == SQLITE_PREFIX + ":memory:":
        return url
    folder = os.path.dirname(os.path.abspath(url[len(SQLITE_PREFIX) :]))
    if os.path.isdir(folder):
        return url
    output_dir = OmegaConf.select(config, "output_dir", default=None)
    if output_dir is None or os.path.abspath(str(output_dir)) != folder:
        raise SweepConfigError(
            "hydra.sweeper.storage",
            url,
            f"a SQLite file in an existing folder ({folder} does not exist)",
        )
    if create:
        os.makedirs(folder, exist_ok=True)
    return url


SQLITE_PREFIX = "sqlite:///"


def open_study(
    name: str | None,
    url: str | None,
    sampler: Any,
    names: list[str],
    directions: list[str],
    heartbeat: tuple[int | None, int | None],
    hardware_id: str,
    facts: dict[str, Any],
    probe: machine.EnvProbe,
    space: Any,  # space.SearchSpace
) -> tuple[optuna.Study, bool]:
    """(the study, whether this call created it). A new one records its objectives and the
    machine it measures; an existing one must have these objectives and a compatible search
    space. `name` None: Optuna's generated name (the stock sweeper's behaviour)."""
    try:
        opened = storage_mod.open_storage(url, *heartbeat)
    except storage_mod.StorageUnreachable as exc:
        raise StorageConnectError(exc) from None
    except (RuntimeError, ValueError, ImportError) as exc:
        raise _invalid_url(url, exc) from None
    try:
        if name is None:  # a new study under Optuna's generated name
            raise KeyError(name)
        study = optuna.load_study(study_name=name, storage=opened, sampler=sampler)
    except KeyError:
        try:
            study = optuna.create_study(
                study_name=name, storage=opened, sampler=sampler, directions=directions
            )
        except optuna.exceptions.DuplicatedStudyError:  # another worker created it just now
            study = optuna.load_study(study_name=name, storage=opened, sampler=sampler)
        else:
            env = {k: v for k, v in probe.data.items() if k != "poor_choices"}
            hardware = {
                "id": hardware_id,
                **facts,
                "env": env,
                "poor_choices": probe.data.get("poor_choices") or [],  # the env's: one per rule
                "dropped": [list(d) for d in space.dropped],
            }
            record.study_attrs(
                study,
                {STUDY_OBJECTIVES: names, STUDY_DIRECTIONS: directions, STUDY_HARDWARE: hardware},
            )
            record.metric_names(study, names)
            return study, True
    stored_dirs = [d.name.lower() for d in study.directions]
    stored_names = study.user_attrs.get(STUDY_OBJECTIVES)
    if stored_dirs != directions or (
        stored_names and not plain_names(stored_names) and stored_names != names
    ):
        raise SweepConfigError(
            "hydra.sweeper.objectives",
            names,
            f"the objectives of existing study {study.study_name!r}: {stored_names or '?'} "
            f"{stored_dirs} (or give another hydra.sweeper.study_name)",
        )
    recorded = study.user_attrs.get(STUDY_HARDWARE) or {}
    if recorded.get("id") and recorded.get("id") != hardware_id:
        log.warning(
            "study %r was measured on other hardware (%s, now %s): its trials do not compare with "
            "this machine's",
            study.study_name,
            recorded.get("id"),
            hardware_id,
        )
    check_search_space(study, space.distributions)
    return study, False


def check_search_space(study: optuna.Study, distributions: dict[str, Any]) -> None:
    """An existing study's trials must have drawn each searched key from a compatible
    distribution: Optuna refuses a changed kind or choices mid-trial; here it is one line up front."""
    seen: dict[str, Any] = {}
    for trial in study.get_trials(deepcopy=False):
        seen.update(trial.distributions)
    for key, new in distributions.items():
        old = seen.get(key)
        if old is None:
            continue
        try:
            optuna.distributions.check_distribution_compatibility(old, new)
        except ValueError:
            raise SweepConfigError(
                key,
                _dist_text(new),
                f"the search space of existing study {study.study_name!r} ({_dist_text(old)}): "
                "give a new hydra.sweeper.study_name, or delete the study "
                f"(optuna delete-study --study-name {study.study_name} --storage URL)",
            ) from None


def space_digest(distributions: dict[str, Any]) -> str | None:
    """Six hex digits of the searched keys and their distributions (None for an empty space):
    part of gpuopt's default study name, so a changed preset or sweep argument is a new study."""
    if not distributions:
        return None
    import hashlib

    text = json.dumps(
        {k: optuna.distributions.distribution_to_json(d) for k, d in sorted(distributions.items())},
        sort_keys=True,
    )
    return hashlib.sha1(text.encode()).hexdigest()[:6]


def _dist_text(dist: Any) -> str:
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return f"choice({', '.join(map(str, dist.choices))})"
    low, high = getattr(dist, "low", "?"), getattr(dist, "high", "?")
    return f"{type(dist).__name__.replace('Distribution', '').lower()}({low}, {high})"


def relabel_plain_objectives(study: optuna.Study, n_values: int) -> None:
    """A stock-style task returned plain values: its objectives are labelled value / value_i,
    not gpuopt metric names (once per sweep, at the first such trial)."""
    labels = study.user_attrs.get(STUDY_OBJECTIVES)
    if labels and not plain_names(labels):
        new = ["value"] if n_values == 1 else [f"value_{i}" for i in range(n_values)]
        record.study_attrs(study, {STUDY_OBJECTIVES: new})
        record.metric_names(study, new)


@dataclass(frozen=True)
class SweepIdentity:
    """Which sweep the outputs describe."""

    study_name: str
    storage: str  # as it may be shown (storage.display: password masked)
    sweep_dir: Path
    names: list[str]
    directions: list[str]
    app_command: str  # how the user starts this app (python -m gpuopt.run, python sphere.py)
    groups: list[str]  # config groups of the composed config (not hydra/...)
    persisted: bool = True  # False: an in-memory study (storage null / memory), gone after the run
    # The app's defaults have no `experiment` group (reproduce with +experiment=best); False for
    # a layout like lightning-hydra-template's (`experiment: null`: experiment=best).
    experiment_added: bool = True
    sweep_groups: list[str] = field(default_factory=list)  # groups that configure the sweep
    metrics_named: bool = True  # gpuopt metrics (speedups) rather than an app's plain values

    def reproduce_experiment(self, name: str) -> str:
        """The command that runs experiment/<name>.yaml of this sweep in this app."""
        plus = "+" if self.experiment_added else ""
        return f"{self.app_command} --config-dir {self.sweep_dir} {plus}{EXPERIMENT_GROUP}={name}"
