"""The rules that read a gpuopt study, one place for the sweeper, its summary and the report:
how a trial ended, which trials are feasible, the baseline, the best, and the two answers' "same
training" (the baseline's global batch and learning rate, numerics within tolerance; never
without evidence: null == null is none).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from gpuopt.study import noise
from gpuopt.study.configs import config_of
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_BASELINE_SKIPPED,
    ATTR_GRID_ID,
    ATTR_INTERRUPTED,
    ATTR_NUMERICS,
    ATTR_STATUS,
    ATTR_VOID,
)
from gpuopt.study.records import Confirmation


def trial_status(trial: FrozenTrial) -> str:
    """How a trial ended: the sweeper's `status` attr for finished trials, else its state."""
    if trial.state in (TrialState.RUNNING, TrialState.WAITING, TrialState.PRUNED):
        return trial.state.name.lower()
    flags = {ATTR_INTERRUPTED: "interrupted", ATTR_BASELINE_SKIPPED: "skipped", ATTR_VOID: "void"}
    # before FAIL = error: none of them is a failed measurement
    flagged = [status for key, status in flags.items() if trial.user_attrs.get(key)]
    if flagged:
        return flagged[0]
    if trial.state == TrialState.FAIL:
        return "error"
    return str(trial.user_attrs.get(ATTR_STATUS, "ok"))


def plain_names(labels: Any) -> bool:
    """Whether a study's objectives are the stock labels of plain return values (value, value_0)."""
    return isinstance(labels, list) and all(str(x).startswith("value") for x in labels)


def plain_labels(n_values: int) -> list[str]:
    """The stock labels of an app's plain return values: `value` for one, `value_0`, ... else."""
    return ["value"] if n_values == 1 else [f"value_{i}" for i in range(n_values)]


def status_counts(trials: Sequence[FrozenTrial]) -> dict[str, int]:
    """Trials per `trial_status`, in the order the statuses first appear."""
    return Counter(trial_status(trial) for trial in trials)


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
    confirmation: Confirmation | None,
) -> FrozenTrial | None:
    """The confirmed winner when a confirmation ran, else the best on the first objective (among
    the Pareto front when there are several)."""
    number = confirmation.winner if confirmation is not None else None
    match = next((t for t in feasible_pool if t.number == number), None)
    if match is not None:
        return match
    pool = [t for t in (pareto or feasible_pool) if not outside_space(t)]
    pool = pool or [t for t in feasible_pool if not outside_space(t)]
    return _best_configuration(pool, feasible_pool, directions)


def _best_configuration(
    pool: Sequence[FrozenTrial], feasible_pool: Sequence[FrozenTrial], directions: Sequence[str]
) -> FrozenTrial | None:
    """The best configuration among `pool`'s by its pooled first objective, as its first trial: a
    repeat of the baseline's configuration is the baseline, never a "best" of its own."""
    of = {t.number: c for c in noise.configurations(feasible_pool) for t in c.trials}
    candidates = [of[t.number] for t in pool if t.number in of]
    sign = 1 if directions[0] == "maximize" else -1
    best = max(candidates, key=lambda c: sign * c.values[0], default=None)
    return None if best is None else best.first


def outside_space(trial: FrozenTrial) -> bool:
    """A baseline run outside a grid's points (grid_id -1): a reference, never the best of it."""
    return bool(trial.user_attrs.get(ATTR_BASELINE)) and trial.system_attrs.get(ATTR_GRID_ID) == -1


def leading_trial(trials: Sequence[FrozenTrial], directions: Sequence[str]) -> FrozenTrial | None:
    """The best feasible trial so far on the first objective (the sweep's progress line)."""
    sign = 1 if directions[0] == "maximize" else -1
    return max(feasible_trials(trials), key=lambda t: sign * t.values[0], default=None)


# ---- same training: the baseline's training math (issue 13) -------------------------------------
NUMERICS_CONSTRAINT = "numerics"  # gpuopt.sweeper.objectives: the numerics guard's verdict
# search=same_training's params: held at the composed config's global batch, and its divisors.
HOLD_BASELINE = "baseline"
DIVISORS = "divisors"
MAX_DIVISORS = 8  # the largest divisors only: tiny micro-batches are never the fast choice


def global_batch_of(trial: FrozenTrial) -> int | None:
    """Samples per optimizer step: the trial's metric, else from its resolved config."""
    value = trial.user_attrs.get("global_batch")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    config = config_of(trial.user_attrs)
    declared = (config.get("train") or {}).get("global_batch")
    batch = declared or (config.get("loader") or {}).get("batch_size")
    return int(batch) if isinstance(batch, int | float) else None


def lr_of(trial: FrozenTrial) -> float | None:
    """The learning rate the trial trained with: its `lr` metric, else (older studies) the resolved
    config's optimizer.lr x the lr_scale it applied."""
    value = trial.user_attrs.get("lr")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    lr = (config_of(trial.user_attrs).get("optimizer") or {}).get("lr")
    scale = trial.user_attrs.get("lr_scale")
    if not isinstance(lr, int | float):
        return None
    return float(lr) * (float(scale) if isinstance(scale, int | float) else 1.0)


def unknown_training(trial: FrozenTrial) -> str | None:
    """What `trial` did not report of its training math (None: both known)."""
    if global_batch_of(trial) is None:
        return "the task did not report its global batch"
    if lr_of(trial) is None:
        return "the task did not report its learning rate"
    return None


def same_training(trial: FrozenTrial, baseline: FrozenTrial | None) -> bool:
    """Whether `trial` trains what the baseline trains (`training_change` finds no change). Two
    unknowns are not equal: only the baseline itself is the same training without evidence."""
    return baseline is not None and training_change(baseline, trial) is None


def pick_same_training(
    feasible_pool: Sequence[FrozenTrial],
    baseline: FrozenTrial | None,
    directions: Sequence[str],
    confirmation: Confirmation | None,
) -> FrozenTrial | None:
    """The best trial that keeps the baseline's training math: the confirmed one where there is
    one, else the best first objective."""
    pool = [t for t in feasible_pool if same_training(t, baseline)]
    number = confirmation.same_training_winner if confirmation is not None else None
    match = next((t for t in pool if t.number == number), None)
    if match is not None:
        return match
    return _best_configuration(pool, feasible_pool, directions)


def training_change(baseline: FrozenTrial | None, trial: FrozenTrial | None) -> str | None:
    """What `trial` changes in the training relative to the baseline, as advice; None when it
    keeps it: the same global batch and effective lr, no numerics violation, another dtype only
    where the guard checked it (or when either trial is missing)."""
    if baseline is None or trial is None or trial.number == baseline.number:
        return None
    if trial.constraints.get(NUMERICS_CONSTRAINT, 0.0) > 0:
        return "numerics drift from the fp32 reference over the tolerance: not the same training"
    evidence = trial.user_attrs.get(ATTR_NUMERICS)
    checked = isinstance(evidence, dict)
    if checked and evidence.get("passed") is None:
        unchecked = evidence.get("not_run") or "no verdict"
        return f"numerics not checked (the guard did not run: {unchecked}): re-validate"
    before, after = baseline.user_attrs.get("compute_dtype"), trial.user_attrs.get("compute_dtype")
    if before and after and before != after and not checked:  # a task of its own has no guard
        return (
            f"computes in another dtype ({before} -> {after}) and no numerics guard checked it "
            "(gpuopt's guard runs in its own app): re-validate the training"
        )
    missing = unknown_training(baseline) or unknown_training(trial)
    if missing:
        before, after = baseline.params, trial.params
        keys = [
            f"{key} ({before[key]} -> {after[key]})" if key in before else f"{key}={after[key]}"
            for key in sorted(after)
            if key not in before or after[key] != before[key]
        ]
        return f"unknown: {missing}; it changes {', '.join(keys) or 'no searched key'}"
    before, after = global_batch_of(baseline), global_batch_of(trial)
    if before == after and math.isclose(lr_of(trial) or 0.0, lr_of(baseline) or 0.0):
        return None
    if not before or not after or before == after:
        return "learning rate differs from the baseline's: re-validate"
    ratio = after / before
    scale = trial.user_attrs.get("lr_scale")
    if isinstance(scale, int | float) and not math.isclose(scale, 1.0):
        return (
            f"global batch {before} -> {after} (x{ratio:.3g}), learning rate scaled x{scale:.3g} "
            "(optimizer.lr_scaling): re-validate"
        )
    return (
        f"global batch {before} -> {after} (x{ratio:.3g}): scale the learning rate and "
        f"re-validate; linear rule: lr x{ratio:.3g}, square-root rule: x{math.sqrt(ratio):.3g}"
    )


def same_training_params(preset: dict[str, str], config: Any) -> dict[str, str]:
    """The preset with its same-training markers resolved against the composed config (the
    baseline): `baseline` -> its global batch, `divisors` -> a choice of that batch's divisors;
    that batch also as the lr scaling's reference (where unset) and the numerics guard's, so a
    trial's math changes are checked apart from its batch change."""
    from omegaconf import OmegaConf

    micro = OmegaConf.select(config, "loader.batch_size", default=None)
    held = OmegaConf.select(config, "train.global_batch", default=None) or micro
    out = dict(preset)
    if held is None:
        return out
    if out.get("train.global_batch") == HOLD_BASELINE:
        out["train.global_batch"] = str(held)
    if out.get("loader.batch_size") == DIVISORS:
        divisors = [d for d in range(1, int(held) + 1) if int(held) % d == 0][-MAX_DIVISORS:]
        out["loader.batch_size"] = f"choice({','.join(map(str, divisors))})"
    rule = OmegaConf.select(config, "optimizer.lr_scaling", default="none")
    reference = OmegaConf.select(config, "optimizer.reference_batch", default=None)
    if rule not in (None, "none") and reference is None:
        out.setdefault("optimizer.reference_batch", str(held))
    guard = OmegaConf.select(config, "guard", default=None)
    if guard is not None and "global_batch" in guard and guard.global_batch is None:
        out.setdefault("guard.global_batch", str(held))  # numerics.guarded_spec
    return out
