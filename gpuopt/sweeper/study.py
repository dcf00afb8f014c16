"""Opening the sweep's study: where it lives, its name, and what a new one records.

A study is created once and resumed by every later run of the same command (and shared by every
worker on it), so opening one checks that it measures the same objectives, warns when it was
measured on other hardware, and on creation records the objectives, directions and hardware.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from typing import Any

import optuna

from . import hardware
from . import storage as storage_mod
from .objectives import SweepConfigError
from .schema import STUDY_DIRECTIONS, STUDY_HARDWARE, STUDY_OBJECTIVES, plain_names

log = logging.getLogger("gpuopt.sweeper")

MEMORY = "memory"


def storage_url(storage: Any, config: Any) -> str | None:
    """`hydra.sweeper.storage` -> what storage.open_storage takes: null -> the SQLite file
    <output_dir>/gpuopt.db (absolute), "memory" -> None (in-memory), anything else as given."""
    from omegaconf import OmegaConf

    if storage is None:
        output_dir = (
            OmegaConf.select(config, "output_dir", default=None)
            or os.environ.get("GPUOPT_OUTPUT_DIR")
            or "outputs"
        )
        cwd = OmegaConf.select(config, "hydra.runtime.cwd", default=None)
        return hardware.default_storage(str(output_dir), cwd)
    if str(storage) == MEMORY:
        return None
    return storage


def open_study(
    name: str,
    url: str | None,
    sampler: Any,
    names: list[str],
    directions: list[str],
    heartbeat: tuple[int | None, int | None],
) -> tuple[optuna.Study, bool]:
    """(the study, whether this call created it); an existing one must have these objectives."""
    opened = storage_mod.open_storage(url, *heartbeat)
    try:
        study = optuna.load_study(study_name=name, storage=opened, sampler=sampler)
        created = False
    except KeyError:
        try:
            study = optuna.create_study(
                study_name=name, storage=opened, sampler=sampler, directions=directions
            )
            created = True
        except optuna.exceptions.DuplicatedStudyError:  # another worker created it just now
            study = optuna.load_study(study_name=name, storage=opened, sampler=sampler)
            created = False
    if not created:
        check_objectives(study, names, directions)
    return study, created


def check_objectives(study: optuna.Study, names: list[str], directions: list[str]) -> None:
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


def warn_other_hardware(study: optuna.Study, hardware_id: str) -> None:
    recorded = study.user_attrs.get(STUDY_HARDWARE) or {}
    if recorded.get("id") and recorded.get("id") != hardware_id:
        log.warning(
            "study %r was measured on other hardware (%s, now %s): its trials do not compare with "
            "this machine's",
            study.study_name,
            recorded.get("id"),
            hardware_id,
        )


def record_new_study(
    study: optuna.Study,
    names: list[str],
    directions: list[str],
    hardware_id: str,
    facts: dict[str, Any],
    probe: hardware.EnvProbe,
    dropped: list[tuple[str, str, str]],
) -> None:
    """What a new study records: its objectives and the machine it measures."""
    study.set_user_attr(STUDY_OBJECTIVES, names)
    study.set_user_attr(STUDY_DIRECTIONS, directions)
    env = {k: v for k, v in probe.data.items() if k != "poor_choices"}
    hardware_attr = {
        "id": hardware_id,
        **facts,
        "env": env,
        "poor_choices": probe.poor_choices,
        "dropped": [list(d) for d in dropped],
    }
    study.set_user_attr(STUDY_HARDWARE, json.loads(json.dumps(hardware_attr, default=str)))
    set_metric_names(study, names)


def relabel_plain_objectives(study: optuna.Study, n_values: int) -> None:
    """A stock-style task returned plain values: its objectives are labelled value / value_i,
    not gpuopt metric names (once per sweep, at the first such trial)."""
    labels = study.user_attrs.get(STUDY_OBJECTIVES)
    if labels and not plain_names(labels):
        new = ["value"] if n_values == 1 else [f"value_{i}" for i in range(n_values)]
        study.set_user_attr(STUDY_OBJECTIVES, new)
        set_metric_names(study, new)


def set_metric_names(study: optuna.Study, names: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # experimental API: never worth failing a sweep over
        with contextlib.suppress(Exception):
            study.set_metric_names(names)
