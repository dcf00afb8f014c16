"""Where the time goes, by default for the two trials a user compares: the baseline and the best.

The baseline trial is launched with `profile=on` (its profiled window runs after the timed one,
so its metrics are unchanged). The best gets one extra run with `profile=on` after the sweep
(not a trial), stored in the study user attr `best_profile`. Apps without the group: nothing runs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_OVERRIDES,
    ATTR_PROFILE,
    ATTR_REASON,
    STUDY_BEST_PROFILE,
)
from gpuopt.study.records import Confirmation
from gpuopt.study.rules import feasible, feasible_trials, pick_best
from gpuopt.sweeper import record
from gpuopt.sweeper.options import SweeperOptions

log = logging.getLogger("gpuopt.sweeper")

PROFILE_ON = "profile=on"  # the override that profiles one trial (gpuopt.trial.profiled_window)
BEST_PROFILE_JOB = 20_000  # job index of the best's profiled run (confirmation runs: 10_000+)


def enabled(options: SweeperOptions) -> bool:
    return options.profile and options.gpuopt_task


def best_of(
    study: Any, trials: list[Any], directions: list[str], confirmation: Confirmation | None
) -> tuple[list[Any], list[Any], Any | None]:
    """(the feasible trials, the feasible Pareto front, the sweep's best) as the outputs say them."""
    pool = feasible_trials(trials)
    pareto = [t for t in study.best_trials if feasible(t)] if pool else []
    return pool, pareto, pick_best(pool, pareto, directions, confirmation)


def launch_overrides(
    options: SweeperOptions, trials: list[Any], overrides: list[list[str]]
) -> list[list[str]]:
    """What each trial is launched with: the baseline profiled too (when enabled)."""
    return [
        [*o, PROFILE_ON] if enabled(options) and t.user_attrs.get(ATTR_BASELINE) else o
        for t, o in zip(trials, overrides, strict=True)
    ]


def profile_best(
    study: Any,
    options: SweeperOptions,
    directions: list[str],
    confirmation: Confirmation | None,
    measure: Callable[[list[str], int], Any],
) -> None:
    """One profiled run of the sweep's best (unless it is profiled already: the baseline)."""
    if not enabled(options):
        return
    _, _, best = best_of(study, study.get_trials(deepcopy=False), directions, confirmation)
    if best is None or isinstance(best.user_attrs.get(ATTR_PROFILE), dict):
        return
    overrides = [
        *(best.user_attrs.get(ATTR_OVERRIDES) or []),
        PROFILE_ON,
        "hydra.sweep.subdir=profile/best",
    ]
    outcome = measure(overrides, BEST_PROFILE_JOB)
    profile = outcome.user_attrs.get(ATTR_PROFILE) if not outcome.failed else None
    if not isinstance(profile, dict):
        reason = outcome.user_attrs.get(ATTR_REASON, outcome.status)
        log.warning("the best trial #%d could not be profiled: %s", best.number, reason)
        return
    record.study_attrs(study, {STUDY_BEST_PROFILE: {"trial": best.number, "profile": profile}})
    log.info(
        "profiled the best trial #%d (where the time goes: python -m gpuopt.report --html)",
        best.number,
    )
