"""What a gpuopt study holds, and the rules that read it: one place for the sweeper, its summary
and the report.

- Attribute keys: every trial/study user and system attribute gpuopt writes (the string values are
  the stored format: never change one).
- `trial_status`: how a trial ended (ok | oom | diverged | error | void | interrupted | running |
  waiting | pruned).
- `feasible` / `feasible_trials`: COMPLETE, with values, and no constraint violated (oom/diverged
  trials are COMPLETE with constraint 1.0, so samplers learn the region; they are never "best").
- `pick_baseline` / `pick_best`: which trial is the baseline and which the best.

Torch-free and light (optuna only): the sweeping process and the report both import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from gpuopt.result import (
    ATTR_BASELINE,
    ATTR_CONFIG,
    ATTR_ENV,
    ATTR_OVERRIDES,
    ATTR_REASON,
    ATTR_RUN_DIR,
    ATTR_STATUS,
    ATTR_WARNINGS,
    STUDY_CONFIRMATION,
    STUDY_DIRECTIONS,
    STUDY_HARDWARE,
    STUDY_OBJECTIVES,
)

from .gpus import ATTR_VISIBLE_DEVICES

# ---- trial user attrs (besides gpuopt.result's: status, reason, overrides, run_dir, env, config,
# warnings, baseline, and every metric flat under its own name) ----------------------------------
ATTR_TRACEBACK = "traceback"  # head and tail of an error trial's traceback or log
ATTR_LOGS = "logs"  # paths of the trial job's full stdout and stderr logs (gpuopt's launchers)
INTERRUPTED_ATTR = "interrupted"  # True on a trial whose sweep died under it
RERUN_OF_ATTR = "rerun_of"  # on the re-enqueued trial: number of the interrupted one
VOID_ATTR = "void"  # why a trial was asked but never run (surplus, duplicate baseline)
# On a baseline that could not run as composed (e.g. a key only custom_search_space adds): why.
# Such a trial also has VOID_ATTR: it never counts towards n_trials, the failure rate or best.
BASELINE_SKIPPED_ATTR = "baseline_skipped"

# ---- trial system attrs -------------------------------------------------------------------------
OWNER_ATTR = "gpuopt:owner"  # {"host", "pid", "start"} of the sweeping process running it
HEARTBEAT_ATTR = "gpuopt:heartbeat"  # journal storage: unix time of the trial's last beat
# Optuna's own, written when gpuopt enqueues a trial by hand (what study.enqueue_trial writes) and
# read by GridSampler: the params a WAITING trial starts with, its grid point and grid.
FIXED_PARAMS_ATTR = "fixed_params"
GRID_ID_ATTR = "grid_id"
SEARCH_SPACE_ATTR = "search_space"

# ---- study system attrs -------------------------------------------------------------------------
CONFIRM_CLAIM_ATTR = "gpuopt:confirm_claim"  # the worker running the confirmation round

__all__ = [
    "ATTR_BASELINE",
    "ATTR_CONFIG",
    "ATTR_ENV",
    "ATTR_LOGS",
    "ATTR_OVERRIDES",
    "ATTR_REASON",
    "ATTR_RUN_DIR",
    "ATTR_STATUS",
    "ATTR_TRACEBACK",
    "ATTR_VISIBLE_DEVICES",
    "ATTR_WARNINGS",
    "BASELINE_SKIPPED_ATTR",
    "CONFIRM_CLAIM_ATTR",
    "FIXED_PARAMS_ATTR",
    "GRID_ID_ATTR",
    "HEARTBEAT_ATTR",
    "INTERRUPTED_ATTR",
    "OWNER_ATTR",
    "RERUN_OF_ATTR",
    "SEARCH_SPACE_ATTR",
    "STUDY_CONFIRMATION",
    "STUDY_DIRECTIONS",
    "STUDY_HARDWARE",
    "STUDY_OBJECTIVES",
    "VOID_ATTR",
    "feasible",
    "feasible_trials",
    "leading_trial",
    "outside_space",
    "pick_baseline",
    "pick_best",
    "plain_labels",
    "plain_names",
    "status_counts",
    "trial_status",
    "winner",
]


def trial_status(trial: FrozenTrial) -> str:
    """How a trial ended: the sweeper's `status` attr for finished trials, else its state.

    interrupted (its sweep died under it; the params were re-run), skipped (a baseline that could
    not run as composed) and void (asked, never run: surplus or a duplicate baseline) come before
    FAIL = error: none is a failed measurement.
    """
    if trial.state == TrialState.RUNNING:
        return "running"
    if trial.state == TrialState.WAITING:
        return "waiting"
    if trial.state == TrialState.PRUNED:
        return "pruned"
    if trial.user_attrs.get(INTERRUPTED_ATTR):
        return "interrupted"
    if trial.user_attrs.get(BASELINE_SKIPPED_ATTR):
        return "skipped"
    if trial.user_attrs.get(VOID_ATTR):
        return "void"
    if trial.state == TrialState.FAIL:
        return "error"
    return str(trial.user_attrs.get(ATTR_STATUS, "ok"))


def plain_names(labels: Any) -> bool:
    """Whether a study's STUDY_OBJECTIVES are placeholder labels (value, value_0, ...): a stock-style
    task's plain float/list return values, not gpuopt metrics."""
    return isinstance(labels, list) and all(str(x).startswith("value") for x in labels)


def plain_labels(n_values: int) -> list[str]:
    """The stock labels of an app's plain return values: `value` for one, `value_0`, ... else."""
    return ["value"] if n_values == 1 else [f"value_{i}" for i in range(n_values)]


def status_counts(trials: Sequence[FrozenTrial]) -> dict[str, int]:
    """Trials per `trial_status`, in the order the statuses first appear."""
    counts: dict[str, int] = {}
    for trial in trials:
        status = trial_status(trial)
        counts[status] = counts.get(status, 0) + 1
    return counts


def feasible(trial: FrozenTrial) -> bool:
    """No constraint violated (a trial without constraints, a stock task's, is feasible)."""
    return all(v <= 0 for v in trial.constraints.values())


def feasible_trials(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that may be best: COMPLETE, with values, feasible."""
    return [t for t in trials if t.state == TrialState.COMPLETE and t.values and feasible(t)]


def pick_baseline(trials: Sequence[FrozenTrial]) -> FrozenTrial | None:
    """The study's baseline trial: the one that ran ok, else the last one flagged (an interrupted
    baseline is re-run under the same flag, so several can be flagged)."""
    flagged = [t for t in trials if t.user_attrs.get(ATTR_BASELINE)]
    return next((t for t in flagged if trial_status(t) == "ok"), flagged[-1] if flagged else None)


def pick_best(
    feasible_pool: Sequence[FrozenTrial],
    pareto: Sequence[FrozenTrial],
    directions: Sequence[str],
    confirmation: dict[str, Any] | None,
) -> FrozenTrial | None:
    """The confirmed winner when a confirmation ran (the baseline unless a candidate is measurably
    faster: confirm.winner), else the best on the first objective (among the Pareto front when
    there are several objectives)."""
    if not feasible_pool:
        return None
    if confirmation:
        number = winner(confirmation)
        match = next((t for t in feasible_pool if t.number == number), None)
        if match is not None:
            return match
    sign = 1 if directions[0] == "maximize" else -1
    pool = [t for t in (pareto or feasible_pool) if not outside_space(t)]
    pool = pool or [t for t in feasible_pool if not outside_space(t)]
    return max(pool, key=lambda t: sign * t.values[0]) if pool else None


def outside_space(trial: FrozenTrial) -> bool:
    """A baseline run outside a grid's points (grid_id -1, no params): a reference, never the
    best of a search it was not part of (the confirmation may still say "keep it")."""
    return bool(trial.user_attrs.get(ATTR_BASELINE)) and trial.system_attrs.get(GRID_ID_ATTR) == -1


def leading_trial(trials: Sequence[FrozenTrial], directions: Sequence[str]) -> FrozenTrial | None:
    """The best feasible trial so far on the first objective (the sweep's progress line)."""
    sign = 1 if directions[0] == "maximize" else -1
    best = None
    for t in feasible_trials(trials):
        if best is None or sign * t.values[0] > sign * best.values[0]:
            best = t
    return best


def winner(record: dict[str, Any]) -> int | None:
    """Trial number of the confirmed winner of a stored confirmation record (the baseline's when
    no candidate is measurably faster); None for a record without configs."""
    configs = record.get("configs") or []
    if not configs:
        return None
    faster = [
        entry
        for entry in record.get("comparisons") or []
        if (entry.get("ratio") or 0.0) > 1.0 and entry.get("distinguishable") is not False
    ]
    if not faster:
        return configs[0].get("trial_number")
    return max(faster, key=lambda entry: entry["ratio"]).get("trial_number")
