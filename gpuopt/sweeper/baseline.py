"""The baseline: the user's configuration as composed, measured once per study (`baseline=True`).

Enqueued before the sampler's trials. GridSampler hands points out by trial number, so a pinned
trial would take a point twice: when the composed config is a grid point, the grid trial that
reaches it is marked baseline (`mark_grid_point`); else the baseline runs outside the grid."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, Trial

from gpuopt.core import knobs
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_BASELINE_SKIPPED,
    ATTR_FIXED_PARAMS,
    ATTR_GRID_ID,
    ATTR_REASON,
    ATTR_SEARCH_SPACE,
    ATTR_VOID,
    STUDY_SEEDS,
)
from gpuopt.sweeper import global_batch, owners, record
from gpuopt.sweeper.seeding import LOW_PRECISION, SeedFacts, describe_split, plan_seeds
from gpuopt.sweeper.space import SearchSpace, baseline_params, current_value

log = logging.getLogger("gpuopt.sweeper")

OUTSIDE_GRID = -1  # the grid_id of a baseline that is not one of the grid's points


def prepare(
    study: optuna.Study, config: Any, space: SearchSpace, created_study: bool
) -> dict[str, Any] | None:
    """Make sure the study will measure a baseline (its creator, or whoever resumes a study without
    one enqueues it, as a WAITING trial); the grid point to mark, if any."""
    trials = study.get_trials(deepcopy=False)
    if owners.has_baseline(trials) or any(t.user_attrs.get(ATTR_BASELINE_SKIPPED) for t in trials):
        return None  # measured, on its way, or known not to run as composed
    fitting, outside = baseline_params(config, space.distributions)
    if space.is_grid and not outside:  # every grid key holds one of its grid values
        # Every worker marks it when its grid trial comes up: at most one trial has it.
        log.info("baseline: the configuration as composed is a grid point; marked when run")
        return fitting
    if not (created_study or trials):
        return None
    for key in outside:
        log.info(
            "baseline: %s=%s is outside the search space: the baseline keeps it as configured",
            key,
            current_value(config, key),
        )
    system_attrs: dict[str, Any] = {ATTR_FIXED_PARAMS: fitting}
    if space.is_grid:
        # Some key of the config is not a grid value: the baseline runs as composed, outside the
        # grid, with the attrs GridSampler needs.
        system_attrs = {ATTR_FIXED_PARAMS: {}, ATTR_GRID_ID: OUTSIDE_GRID, ATTR_SEARCH_SPACE: {}}
    record.add_waiting_trial(study, system_attrs, {ATTR_BASELINE: True})
    return None


def launcher_failed(ret: Any) -> bool:
    """Whether the job failed outside the task (the launcher raised, or the trial process ended
    without a result): such a baseline is a failed trial, not a configuration that cannot run."""
    if isinstance(ret, BaseException):
        return True
    try:
        ret.return_value  # noqa: B018  (raises the task's exception)
    except BaseException as exc:
        return getattr(exc, "log_tail", None) is not None
    return False


def skip(study: optuna.Study, trial: Trial, overrides: list[str], ret: Any, outcome: Any) -> None:
    """A baseline whose task raised: the composed configuration does not run on its own (e.g. it reads
    a key only custom_search_space adds). Told FAIL, marked skipped and void: never counted or best."""
    from gpuopt.sweeper.record import record_trial

    reason = str(outcome.user_attrs.get(ATTR_REASON) or outcome.status).strip().splitlines()[0]
    outcome.user_attrs[ATTR_BASELINE_SKIPPED] = reason
    outcome.user_attrs[ATTR_VOID] = f"baseline skipped: {reason}"
    record_trial(study, trial, overrides, ret, outcome)
    log.warning("baseline skipped: %s (trial #%d; not a failed trial)", reason, trial.number)


def grid_trials(space: SearchSpace, trials: Sequence[FrozenTrial]) -> int:
    """The trials a grid sweep runs: the grid's size, plus a baseline that is not one of its
    points."""
    return space.grid_size + sum(
        1
        for t in trials
        if t.system_attrs.get(ATTR_GRID_ID) == OUTSIDE_GRID and owners.has_baseline([t])
    )


def pinned_params(trial: Trial) -> dict[str, Any]:
    """The params a baseline trial was enqueued with (the searched keys it fits)."""
    from gpuopt.core._compat import trial_id

    return trial.storage.get_trial_system_attrs(trial_id(trial)).get(ATTR_FIXED_PARAMS) or {}


def mark_grid_point(trial: Trial, point: dict[str, Any]) -> bool:
    """Mark `trial` baseline when the grid reached the composed config's point (and no other
    worker marked one first); True when the point was reached."""
    if trial.params != point:
        return False
    if not owners.has_baseline(trial.study.get_trials(deepcopy=False)):
        record.trial_attrs(trial.study, trial, {ATTR_BASELINE: True})
    return True


# ---- expert seeds after the baseline (seeding.py) -------------------------------------------------


def seed_facts(baseline_attrs: dict[str, Any], study_attrs: dict[str, Any]) -> SeedFacts:
    """What the baseline trial measured (its user attrs) and what the env probe said (the study's
    hardware attr), as seeding's facts."""
    env = baseline_attrs.get("env") or {}
    probe = (study_attrs.get("hardware") or {}).get("env") or {}
    poor = knobs.judge(knobs.PRECISION.key, LOW_PRECISION, probe)  # emulated, or slow here
    return SeedFacts(
        device_type=str(env.get("device") or probe.get("device") or "cpu").split(":")[0],
        cores=int(env.get("usable_cpus") or probe.get("cpus") or 1),
        loader_cost_us=baseline_attrs.get("loader_cost_us"),
        compute_cost_us=baseline_attrs.get("compute_cost_us"),
        ceiling_throughput=baseline_attrs.get("ceiling_throughput"),
        limit_bound=baseline_attrs.get("limit_bound"),
        native_low_precision=bool(probe.get("bf16_native")) and not poor,
    )


def enqueue_seeds(
    study: optuna.Study, trial: Trial, outcome: Any, space: SearchSpace, n_trials: int | None = None
) -> None:
    """After the baseline's result: enqueue the expert seeds, once per study (not on a grid, not
    after a failed baseline). Only as many as the study has room for (`seed_room`): a seed past
    n_trials would wait in the study forever."""
    if space.is_grid or not outcome.feasible or STUDY_SEEDS in study.user_attrs:
        return
    facts = seed_facts(outcome.user_attrs, study.user_attrs)
    room = None if n_trials is None else seed_room(study.get_trials(deepcopy=False), n_trials)
    rule = global_batch.read(study.user_attrs)
    choices = {k: list(d.choices) for k, d in space.distributions.items() if hasattr(d, "choices")}
    seeds = plan_seeds(facts, choices, dict(trial.params), rule, room)
    record.study_attrs(study, {STUDY_SEEDS: [{"params": s.params, "why": s.why} for s in seeds]})
    log.info("seeding: %s", describe_split(facts))
    for seed in seeds:
        # a partial seed (the batch keys only) may repeat: each is one of the sampler's trials
        record.enqueue(study, seed.params, {"seed": seed.why}, not seed.partial)
        log.info("seeding: enqueued %s (%s)", seed.params, seed.why)


def seed_room(trials: Sequence[FrozenTrial], n_trials: int) -> int:
    """Trials the study can still add: n_trials less those that count or are queued."""
    return max(0, n_trials - owners.held(trials))
