"""Which sampled parameters mattered: per-objective importances over a study's ok trials
(PED-ANOVA, Optuna's default evaluator), for the report's table and its charts."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from gpuopt.study.storage import in_memory_copy

# Parameter importances need enough finished trials to mean anything (PED-ANOVA compares the top
# quantile of trials with the rest).
MIN_TRIALS_FOR_IMPORTANCE = 6


def importance_target(direction: optuna.study.StudyDirection, index: int) -> Any:
    """PED-ANOVA ranks parameters by how they reach LOW target values: negate maximized ones."""
    sign = -1.0 if direction == optuna.study.StudyDirection.MAXIMIZE else 1.0
    return lambda trial: sign * trial.values[index]


@contextlib.contextmanager
def quiet_ped_anova() -> Iterator[None]:
    """Optuna warns whenever a `target` is given (importance_target handles the sign) and on few
    trials per choice, the normal case for a sweep (the table says PED-ANOVA)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes")
        warnings.filterwarnings("ignore", message="Some regimes for parameter")
        yield


def param_importances(
    study: optuna.Study, trials: list[FrozenTrial], objectives: list[str]
) -> tuple[dict[str, dict[str, float]], str | None]:
    """Per-objective importances, and a note where there are none; over an in-memory copy of the
    ok trials: infeasible ones' worst-case values would make every OOM-prone parameter look
    important."""
    with_params = [t for t in trials if t.params]
    if len(with_params) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}, (
            f"parameter importances need >= {MIN_TRIALS_FOR_IMPORTANCE} completed ok trials "
            f"with parameters; this study has {len(with_params)}"
        )
    varied = {
        name
        for t in with_params
        for name in t.params
        if any(u.params.get(name) != t.params[name] for u in with_params)
    }
    if not varied:
        return {}, "no parameter varied between the ok trials"
    copy = in_memory_copy(study, with_params)
    result: dict[str, dict[str, float]] = {}
    for index, name in enumerate(objectives):
        try:
            with quiet_ped_anova():
                result[name] = optuna.importance.get_param_importances(
                    copy,
                    params=sorted(varied),
                    target=importance_target(study.directions[index], index),
                )
        except (ValueError, RuntimeError) as exc:  # e.g. too few distinct values
            return result, f"parameter importances unavailable: {exc}"
    return result, None
