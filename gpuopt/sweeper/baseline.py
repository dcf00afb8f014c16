"""The baseline: the user's configuration as composed, measured once per study (`baseline=True`).

Every speedup is relative to it, so it is enqueued (a WAITING trial with the configured values of
the searched keys) before the sampler's trials, by the worker that created the study or by
whoever resumes a study without one.

Grid sweeps differ: GridSampler hands grid points out by trial number, so a pinned trial would
take a point twice and leave another out. When the composed config is itself a grid point, no
trial is added: the grid trial that reaches that point is marked baseline (`mark_grid_point`).
Otherwise the baseline runs outside the grid (grid_id -1), one trial on top of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from . import resume
from .schema import (
    ATTR_BASELINE,
    ATTR_REASON,
    BASELINE_SKIPPED_ATTR,
    FIXED_PARAMS_ATTR,
    GRID_ID_ATTR,
    INTERRUPTED_ATTR,
    SEARCH_SPACE_ATTR,
    VOID_ATTR,
)
from .search_space import SearchSpace, baseline_params, current_value

log = logging.getLogger("gpuopt.sweeper")

OUTSIDE_GRID = -1  # the grid_id of a baseline that is not one of the grid's points


def grid_point(config: Any, space: SearchSpace) -> dict[str, Any] | None:
    """The composed config's params when every grid key holds one of its grid values."""
    fitting, outside = baseline_params(config, space.distributions)
    return fitting if not outside and set(fitting) == set(space.distributions) else None


def prepare(
    study: optuna.Study, config: Any, space: SearchSpace, created_study: bool
) -> dict[str, Any] | None:
    """Make sure the study will measure a baseline; returns the grid point to mark, if any.

    A new study: its creator enqueues the baseline (workers started with it leave that to it); an
    existing study without one gets it from whoever resumes it.
    """
    trials = study.get_trials(deepcopy=False)
    if resume.has_baseline(trials) or any(t.user_attrs.get(BASELINE_SKIPPED_ATTR) for t in trials):
        return None  # measured, on its way, or known not to run as composed
    point = grid_point(config, space) if space.is_grid else None
    if point is not None:
        # Every worker marks it when its grid trial comes up: at most one trial has it.
        log.info("baseline: the configuration as composed is a grid point; marked when run")
        return point
    if created_study or trials:
        enqueue(study, config, space)
    return None


def enqueue(study: optuna.Study, config: Any, space: SearchSpace) -> None:
    """Add the baseline as a WAITING trial (what study.enqueue_trial does, plus grid attrs)."""
    fitting, outside = baseline_params(config, space.distributions)
    for key in outside:
        log.info(
            "baseline: %s=%s is outside the search space: the baseline keeps it as configured",
            key,
            current_value(config, key),
        )
    system_attrs: dict[str, Any] = {FIXED_PARAMS_ATTR: fitting}
    if space.is_grid:
        # Some key of the config is not a grid value: the baseline runs as composed, outside the
        # grid, with the attrs GridSampler needs.
        system_attrs = {FIXED_PARAMS_ATTR: {}, GRID_ID_ATTR: OUTSIDE_GRID, SEARCH_SPACE_ATTR: {}}
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            system_attrs=system_attrs,
            user_attrs={ATTR_BASELINE: True},
        )
    )


def skip(study: optuna.Study, trial: Trial, overrides: list[str], ret: Any, outcome: Any) -> None:
    """A baseline that failed: the configuration as composed does not run on its own (e.g.
    custom-search-space-objective.py reads `w`, which only its custom_search_space adds). It is
    told FAIL with the reason, marked skipped and void: no failed trial for max_failure_rate, not
    counted towards n_trials, never best, and not enqueued again on resume."""
    from .record import record_trial

    reason = str(outcome.user_attrs.get(ATTR_REASON) or outcome.status).strip().splitlines()[0]
    outcome.user_attrs[BASELINE_SKIPPED_ATTR] = reason
    outcome.user_attrs[VOID_ATTR] = f"baseline skipped: {reason}"
    record_trial(study, trial, overrides, ret, outcome)
    log.warning("baseline skipped: %s (trial #%d; not a failed trial)", reason, trial.number)


def grid_trials(space: SearchSpace, trials: Sequence[FrozenTrial]) -> int:
    """The trials a grid sweep runs: the grid's size, plus a baseline that is not one of its
    points."""
    return space.grid_size + sum(
        1
        for t in trials
        if t.user_attrs.get(ATTR_BASELINE)
        and t.system_attrs.get(GRID_ID_ATTR) == OUTSIDE_GRID
        and not t.user_attrs.get(INTERRUPTED_ATTR)
        and not t.user_attrs.get(VOID_ATTR)
    )


def pinned_params(trial: Trial) -> dict[str, Any]:
    """The params a baseline trial was enqueued with (the searched keys it fits)."""
    from ._compat import trial_id

    return trial.storage.get_trial_system_attrs(trial_id(trial)).get(FIXED_PARAMS_ATTR) or {}


def mark_grid_point(trial: Trial, point: dict[str, Any]) -> bool:
    """Mark `trial` baseline when the grid reached the composed config's point (and no other
    worker marked one first); True when the point was reached."""
    if trial.params != point:
        return False
    if not resume.has_baseline(trial.study.get_trials(deepcopy=False)):
        trial.set_user_attr(ATTR_BASELINE, True)
    return True
