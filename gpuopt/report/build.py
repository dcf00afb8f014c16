"""Read an Optuna study written by the gpuopt sweeper into a `StudyReport`: plain data, no printing,
so tests assert on it. The picks (baseline, best, same training) are the sweeper's own
(gpuopt.study.rules), so the report and the sweep's best.yaml agree.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from gpuopt.core.limits import HighestLimit, highest_limit
from gpuopt.core.metrics import compared, goals
from gpuopt.core.secrets import mask_secrets
from gpuopt.report.diagnose import Diagnosis, diagnose
from gpuopt.report.evidence import attr_number
from gpuopt.report.importance import param_importances
from gpuopt.study.answers import same_training_evidence
from gpuopt.study.configs import config_of, flatten
from gpuopt.study.experiment import is_measurement_key, override_diff
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_ENV,
    ATTR_OVERRIDES,
    ATTR_PROFILE,
    STUDY_BEST_PROFILE,
    STUDY_CONFIRMATION,
    STUDY_HARDWARE,
    STUDY_OBJECTIVES,
)
from gpuopt.study.noise import NoiseView, noise_view
from gpuopt.study.records import Confirmation, read_confirmation
from gpuopt.study.rules import (
    feasible,
    feasible_trials,
    global_batch_of,
    pick_baseline,
    pick_best,
    pick_same_training,
    training_change,
    trial_status,
    unknown_training,
)

# Status columns, in display order; other statuses (void, interrupted, pruned, waiting: see
# gpuopt.study.rules.trial_status) are shown only when present.
STATUS_ORDER = ("ok", "oom", "diverged", "error", "running")

# The metrics compared between the baseline and the best trial, in display order.
COMPARED_METRICS = compared()
# Keys of the resolved config that never describe the measured configuration.
IGNORED_CONFIG_KEYS = ("hydra", "output_dir")


def device_type_of(attrs: dict[str, Any], hardware: dict[str, Any] | None) -> str | None:
    """The device a trial ran on ("cuda", "cpu", ...): its env's, the study's, its config's."""
    for env in (attrs.get(ATTR_ENV), (hardware or {}).get("env")):
        device = env.get("device") if isinstance(env, dict) else None
        if isinstance(device, str) and device:
            return device.split(":")[0]
    declared = (config_of(attrs).get("device") or {}).get("type")
    return declared.split(":")[0] if isinstance(declared, str) and declared != "auto" else None


class ReportError(Exception):
    """A problem the user can fix, shown as one line (`gpuopt.report: error: ...`, exit 2)."""


@dataclass
class TrialView:
    """One trial as the report sees it."""

    number: int
    status: str
    values: tuple[float, ...] | None
    params: dict[str, Any]
    attrs: dict[str, Any]
    diagnosis: Diagnosis

    @property
    def baseline(self) -> bool:
        return bool(self.attrs.get(ATTR_BASELINE))

    @property
    def overrides(self) -> list[str] | None:
        value = self.attrs.get(ATTR_OVERRIDES)
        return list(value) if isinstance(value, list) else None

    @property
    def config(self) -> dict[str, Any]:
        return config_of(self.attrs)

    @property
    def profile(self) -> dict[str, Any] | None:
        value = self.attrs.get(ATTR_PROFILE)
        return value if isinstance(value, dict) else None

    def metric(self, name: str) -> float | None:
        return attr_number(self.attrs, name)


@dataclass
class ConfigChange:
    key: str  # dotted key of the resolved config
    baseline: Any
    best: Any


@dataclass
class StudyReport:
    study_name: str
    storage_url: str
    objectives: list[str]
    directions: list[str]
    hardware: dict[str, Any] | None
    counts: dict[str, int]
    trials: list[TrialView]
    baseline: TrialView | None
    best: TrialView | None
    pareto: list[TrialView]  # multi-objective: the ok trials on the Pareto front
    speedup: float | None  # best throughput / baseline throughput
    confirmation: Confirmation | None  # the sweeper's end-of-sweep re-measurement
    override_changes: list[str]  # best overrides not already in the baseline's
    reverted_overrides: list[str]  # baseline overrides the best trial does not use
    config_changes: list[ConfigChange]
    # objective -> param -> share
    importances: dict[str, dict[str, float]] = field(default_factory=dict)
    importance_note: str | None = None
    # The two answers (gpuopt.study.rules): the best that keeps the baseline's training math,
    # and what the best overall changes in the training (None: it keeps it).
    same_training: TrialView | None = None
    training_change: str | None = None
    training_unknown: str | None = None  # what the baseline did not report (rules.unknown_training)
    global_batch: int | None = None  # the baseline's
    same_changes: list[str] = field(default_factory=list)  # (a)'s overrides not in the baseline's
    # (a) is the baseline itself: what the search saw of the same training (answers.py)
    same_evidence: str | None = None
    # The best trial's profiled run (the sweeper profiles the best after the sweep:
    # gpuopt.sweeper.profile_runs), when the best trial itself was not profiled.
    best_profile: dict[str, Any] | None = None
    # The machine's limit as far as the study measured it: the highest of its trials' limits.
    highest_limit: HighestLimit | None = None
    # A stored confirmation attr that is no confirmation record gpuopt wrote (shown as it is).
    unread_confirmation: Any = None
    # Which trials the measurements cannot tell apart (gpuopt.study.noise): the front and the
    # ranking in noise groups; None for an app's own (exact) values.
    noise: NoiseView | None = None

    @property
    def multi_objective(self) -> bool:
        return len(self.directions) > 1

    @property
    def ok_trials(self) -> list[TrialView]:
        return [t for t in self.trials if t.status == "ok" and t.values is not None]

    @property
    def confirmed(self) -> bool:
        """A confirmation ran and compared candidates with the baseline."""
        return self.confirmation is not None and bool(self.confirmation.comparisons)

    def trial(self, number: int) -> TrialView:
        trial = next((t for t in self.trials if t.number == number), None)
        if trial is None:
            raise ReportError(f"study {self.study_name!r} has no trial #{number}")
        return trial


def _objective_names(study: optuna.Study) -> list[str]:
    names = study.user_attrs.get(STUDY_OBJECTIVES)
    if isinstance(names, list) and len(names) == len(study.directions):
        return [str(n) for n in names]
    if study.metric_names and len(study.metric_names) == len(study.directions):
        return list(study.metric_names)
    return (
        ["value"]
        if len(study.directions) == 1
        else [f"value_{i}" for i in range(len(study.directions))]
    )


_ABSENT = "(absent)"


def config_diff(baseline: dict[str, Any], best: dict[str, Any]) -> list[ConfigChange]:
    """The resolved-config keys whose values differ, in the best config's key order."""

    def kept(key: str) -> bool:  # not Hydra's, nor how gpuopt measured (is_measurement_key)
        return key.split(".")[0] not in IGNORED_CONFIG_KEYS and not is_measurement_key(key)

    base_flat = {k: v for k, v in flatten(baseline).items() if kept(k)}
    best_flat = {k: v for k, v in flatten(best).items() if kept(k)}
    keys = list(best_flat) + [k for k in base_flat if k not in best_flat]
    return [
        ConfigChange(k, base_flat.get(k, _ABSENT), best_flat.get(k, _ABSENT))
        for k in keys
        if base_flat.get(k, _ABSENT) != best_flat.get(k, _ABSENT)
    ]


def trial_view(
    trial: FrozenTrial, hardware: dict[str, Any] | None, highest: HighestLimit | None = None
) -> TrialView:
    """One trial with its status and bottleneck diagnosis (against the study's highest limit)."""
    status = trial_status(trial)
    attrs = dict(trial.user_attrs)
    return TrialView(
        number=trial.number,
        status=status,
        values=tuple(trial.values) if trial.values is not None else None,
        params=dict(trial.params),
        attrs=attrs,
        diagnosis=diagnose(
            attrs,
            status=status,
            device_type=device_type_of(attrs, hardware),
            config=config_of(attrs),
            highest=highest,
        ),
    )


def _changes(
    baseline: TrialView | None, best: TrialView | None
) -> tuple[list[str], list[str], list[ConfigChange]]:
    """(best overrides not in the baseline's, baseline overrides the best drops, config diff)."""
    if best is None or baseline is best:
        return [], [], []
    if baseline is None:
        return list(best.overrides or []), [], []
    changes, reverted = override_diff(baseline.overrides or [], best.overrides or [])
    both = baseline.config and best.config
    return changes, reverted, config_diff(baseline.config, best.config) if both else []


def build_report(study: optuna.Study, storage_url: str = "") -> StudyReport:
    """Summarize a study: counts, baseline, best, Pareto front, diff, diagnoses, importances."""
    objectives = _objective_names(study)
    directions = [d.name.lower() for d in study.directions]
    hardware = study.user_attrs.get(STUDY_HARDWARE)
    hardware = hardware if isinstance(hardware, dict) else None
    frozen = study.get_trials(deepcopy=False)

    highest = highest_limit((t.number, t.user_attrs) for t in feasible_trials(frozen))
    views = [trial_view(trial, hardware, highest) for trial in frozen]
    by_number = {v.number: v for v in views}

    counts = Counter(v.status for v in views)
    ordered = {s: counts.get(s, 0) for s in STATUS_ORDER}
    ordered.update({s: n for s, n in counts.items() if s not in ordered})

    # The best: the confirmed winner when a confirmation ran, else the best first objective (on
    # the Pareto front when there are several objectives).
    pool = feasible_trials(frozen)
    pareto_frozen = (
        [t for t in study.best_trials if feasible(t)] if len(directions) > 1 and pool else []
    )
    confirmation = read_confirmation(study.user_attrs)
    picked = pick_best(pool, pareto_frozen, directions, confirmation)
    best = by_number[picked.number] if picked is not None else None
    pareto = [by_number[t.number] for t in pareto_frozen]
    base_trial = pick_baseline(frozen)
    baseline = by_number[base_trial.number] if base_trial is not None else None
    base_tp, best_tp = (t.metric("throughput") if t else None for t in (baseline, best))
    ok_base = baseline is not None and baseline.status == "ok"
    speedup = best_tp / base_tp if ok_base and base_tp and best_tp else None

    changes, reverted, config_changes = _changes(baseline, best)
    same = pick_same_training(pool, base_trial, directions, confirmation)
    same_view = by_number[same.number] if same is not None else None
    global_batch = global_batch_of(base_trial) if base_trial is not None else None

    same_evidence = None  # where answer (a) is the baseline itself: what the search saw of it
    if same is not None and base_trial is not None and same.number == base_trial.number:
        held = f"global batch {global_batch}" if global_batch else "the baseline's global batch"
        same_evidence = same_training_evidence(frozen, base_trial, confirmation, held)
    # noise groups where an objective is one of gpuopt's (noisy) metrics; an app's are exact
    noisy = pool and any(name in goals() for name in objectives)
    ok_numbers = {v.number for v in views if v.status == "ok"}
    importances, note = param_importances(
        study, [t for t in pool if t.number in ok_numbers], objectives
    )

    return StudyReport(
        study_name=study.study_name,
        storage_url=mask_secrets(storage_url),  # a report never shows a storage password
        objectives=objectives,
        directions=directions,
        hardware=hardware,
        counts=ordered,
        trials=views,
        baseline=baseline,
        best=best,
        pareto=pareto,
        speedup=speedup,
        confirmation=confirmation,
        override_changes=changes,
        reverted_overrides=reverted,
        config_changes=config_changes,
        importances=importances,
        importance_note=note,
        same_training=same_view,
        training_change=training_change(base_trial, picked),
        training_unknown=unknown_training(base_trial) if base_trial is not None else None,
        global_batch=global_batch,
        same_changes=_changes(baseline, same_view)[0],
        same_evidence=same_evidence,
        best_profile=_best_profile(study, best),
        highest_limit=highest,
        unread_confirmation=(
            study.user_attrs.get(STUDY_CONFIRMATION) if confirmation is None else None
        ),
        noise=noise_view(pool, objectives, directions) if noisy else None,
    )


def _best_profile(study: optuna.Study, best: TrialView | None) -> dict[str, Any] | None:
    stored = study.user_attrs.get(STUDY_BEST_PROFILE)
    if best is None or not isinstance(stored, dict) or stored.get("trial") != best.number:
        return None
    return stored.get("profile") if isinstance(stored.get("profile"), dict) else None
