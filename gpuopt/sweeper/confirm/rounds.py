"""The confirmation round: re-measure the baseline and the top candidates, interleaved, in pairs.

Throughput of one configuration drifts 4-14% between fresh processes on these machines, so the
sweep's single measurement per configuration can crown a lucky one. At the end the baseline (A)
and the top-k candidates (B1, B2, ...) run again as A B1 B2, B2 B1 A, ..., each run a fresh
process (a long-lived process reads 10-35% faster, so in-process numbers must never meet
fresh-process ones), or, where the configurations can share one, as alternating windows of one
process (in_process.py). How many rounds: Stein's two-stage procedure (comparison.PairStop), up to
the `confirm.max_share` cap. When no candidate is measurably faster, the baseline wins.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuopt.core.stats import LEVEL
from gpuopt.study.keys import (
    ATTR_CONFIG,
    ATTR_OWNER,
    ATTR_RACE,
    STUDY_OBJECTIVES,
)
from gpuopt.study.records import (
    FRESH_PROCESSES,
    IN_PROCESS,
    Comparison,
    Confirmation,
    ConfirmedConfig,
    read_confirmation,
)
from gpuopt.study.rules import plain_names
from gpuopt.sweeper import comparison, owners, resume
from gpuopt.sweeper.comparison import Budget, Compared, Executor, Measurement, PairStop
from gpuopt.sweeper.confirm import in_process
from gpuopt.sweeper.confirm.schedule import (
    WINDOW_OBJECTIVES,
    ConfirmPlan,
    Pending,
    answers_among,
    candidates,
    confirmed_configs,
    labels,
    lean_overrides,
    plan,
    with_overrides,
    with_same_training_pick,
)
from gpuopt.sweeper.confirm.verdicts import compare
from gpuopt.sweeper.options import ConfirmOptions
from gpuopt.sweeper.record import store_confirmation

log = logging.getLogger("gpuopt.sweeper")

FIRST_CONFIRM_JOB = 10_000  # the confirmation runs' job numbers (the sweep's trials: from 0)
# The fresh-process confirmation's interval: 98%, not 95%. Its pairs are whole processes, each with
# its own layout draw, and few (the default cap: 5); a claim from them is the one a user acts on,
# and the goal for it is <= 3% false claims in A/A, which a 95% interval's nominal 5% cannot meet
# by construction. Measured (docs/benchmarks.md, "The fresh-process confirmation's level").
FRESH_LEVEL = 0.98


def confirm_if_last(
    study: Any,
    settings: ConfirmOptions,
    *,
    names: Sequence[str],
    directions: Sequence[str],
    n_trials: int,
    sweep_dir: str,
    measure: Callable[[list[str], int], Any],
    compose: Callable[[list[str]], Any] | None = None,
    app_config: Mapping[str, Any] | None = None,
) -> Confirmation | None:
    """Plan, claim and run the round in the last worker to finish (the others return the stored
    record, if any); store and return its record (None when it does not run).
    `measure(overrides, index)`: one fresh-process run's TrialOutcome; `compose(overrides)`: a
    job's config, for the in-process mode; `app_config`: the config the overrides apply to."""
    all_trials = study.get_trials(deepcopy=False)
    previous = read_confirmation(study.user_attrs)
    others = owners.running_elsewhere(all_trials)
    if others:
        log.info(
            "%d trial(s) still running in other workers: the last worker to finish runs the "
            "confirmation round",
            len(others),
        )
        return previous
    if plain_names(study.user_attrs.get(STUDY_OBJECTIVES)):
        return None  # a stock-style task: its values are not noisy measurements to confirm
    counted = sum(1 for t in all_trials if owners.counted(t))
    if previous is not None and previous.after_trials == counted:
        return previous  # nothing new since the last confirmation
    baseline, ranked, feasible = candidates(all_trials, directions)
    if baseline is None:
        return None
    ranked, top_k = with_same_training_pick(ranked, baseline, settings.top_k)
    keep = answers_among(ranked, baseline)  # both answers confirmed, in fewer rounds if need be
    confirm_plan = plan(top_k, settings.rounds, settings.max_share, n_trials, len(ranked), keep)
    if confirm_plan is None:
        if settings.rounds > 0 and not ranked:  # the summary then says its best is unconfirmed
            log.info(
                "confirmation round skipped: no feasible candidate other than the baseline's own "
                "configuration"
            )
        elif settings.rounds > 0:
            log.info(
                "confirmation round skipped: %.0f%% of n_trials=%d allows fewer than 2 rounds "
                "(hydra.sweeper.confirm.max_share)",
                100 * settings.max_share,
                n_trials,
            )
        return None
    if not resume.claim_confirmation(study, counted):
        log.info("another worker runs the confirmation round")
        return previous
    rule = Rule(directions[0], settings.target_halfwidth)
    measured = None
    if settings.in_process and compose is not None and names[0] in WINDOW_OBJECTIVES:
        # windows are cheap: the top_k asked for, not the fresh-process cap's
        chosen = [baseline, *ranked[:top_k]]
        measured = in_process_rounds(
            chosen, feasible, confirm_plan, names[0], rule, compose, settings.window_s, sweep_dir
        )
    if measured is None:
        chosen = [baseline, *ranked[: confirm_plan.top_k]]
        # The overrides apply to the app's config, which need not hold the trial's measure.* keys
        # (gpuopt.measure_step's own MeasureConf is in the trial's config, not in the app's).
        lean = lean_overrides(
            names[0], app_config if app_config is not None else baseline.user_attrs.get(ATTR_CONFIG)
        )
        configs = confirmed_configs(chosen)
        runs = fresh_process_runs(measure, lean, configs)
        rule = replace(rule, level=FRESH_LEVEL)
        done = run_rounds(configs, confirm_plan, names[0], runs, rule)
        measured = Measured(names[0], configs, confirm_plan, done, FRESH_PROCESSES, lean=lean)
    return store_confirmation(study, measured.record(rule, counted, sweep_dir))


@dataclass(frozen=True)
class Rule:
    """The objective's direction, the interval's +-target and its confidence."""

    direction: str
    target: float
    level: float = LEVEL


@dataclass
class Measured:
    """The rounds as run: under which plan, how (`mode`, with its window in-process or fresh
    runs' lean overrides), the comparison's readings."""

    objective: str
    configs: list[ConfirmedConfig]
    plan: ConfirmPlan
    done: Compared
    mode: str
    window_s: float | None = None
    lean: list[str] = field(default_factory=list)

    def record(self, rule: Rule, after_trials: int, sweep_dir: str) -> Confirmation:
        """The confirmation's record (the study's user attr)."""
        done, first = self.done, self.plan.rounds
        verdicts = compare(
            self.configs, rule.direction, rule.target, first, done.loads, done.steal_pct, rule.level
        )
        top_two = verdicts["top_two"]
        return Confirmation(
            configs=tuple(self.configs),
            comparisons=tuple(Comparison.from_attr(entry) for entry in verdicts["comparisons"]),
            top_two=None if top_two is None else Comparison.from_attr(top_two),
            objective=self.objective,
            direction=rule.direction,
            mode=self.mode,
            window_s=self.window_s,
            rounds=done.rounds,
            first_stage=first,
            top_k=self.plan.top_k,
            after_trials=after_trials,
            runs=done.runs,
            max_runs=self.plan.max_runs,
            lean_overrides=tuple(self.lean),
            time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            sweep_dir=sweep_dir,
            same_training_flagged=True,
        )


def in_process_rounds(
    chosen: Sequence[Any],
    feasible: Sequence[Any],
    fresh_plan: ConfirmPlan,
    objective: str,
    rule: Rule,
    compose: Callable[[list[str]], Any],
    window_s: float,
    sweep_dir: str,
) -> Measured | None:
    """The rounds as alternating windows of one shared process, within the fresh-process plan's
    time; None when the chosen trials cannot share one."""
    directory = Path(sweep_dir) / "confirm"
    shared = in_process.open_shared(chosen, labels(chosen), compose, objective, window_s, directory)
    if shared is None:
        return None
    first, cap = in_process.window_plan(
        fresh_plan.rounds,
        fresh_plan.max_runs,
        trial_seconds(feasible),
        [in_process.window_seconds(t, window_s) for t in chosen],
    )
    window_plan = ConfirmPlan(len(chosen) - 1, first, cap)
    configs = confirmed_configs(chosen)
    try:
        done = run_rounds(
            configs,
            window_plan,
            objective,
            in_process.fresh_build_windows(shared),
            rule,
            how=f"alternating {window_s:g} s windows in one process",
        )
    finally:
        shared.close()
    return Measured(objective, configs, window_plan, done, IN_PROCESS, window_s)


def trial_seconds(trials: Sequence[Any]) -> list[float]:
    """How long each finished trial took (a raced trial: its whole-trial command, since it was
    asked long before it ran)."""
    seconds = []
    for t in trials:
        raced = t.user_attrs.get(ATTR_RACE)
        if isinstance(raced, dict) and isinstance(raced.get("seconds"), (int, float)):
            seconds.append(float(raced["seconds"]))
        elif t.datetime_start is not None and t.datetime_complete is not None:
            seconds.append((t.datetime_complete - t.datetime_start).total_seconds())
    return seconds


def run_rounds(
    configs: Sequence[ConfirmedConfig],
    confirm_plan: ConfirmPlan,
    objective: str,
    executor: Executor,
    rule: Rule,
    load: Callable[[], float] = lambda: os.getloadavg()[0],
    how: str = "interleaved, fresh processes",
) -> Compared:
    """The comparison service's rounds of the candidates around the baseline (configs[0]), with
    Stein's two-stage stop; each config's record gets its re-measurements."""
    base, cands = configs[0], configs[1:]
    log.info(
        "confirmation: %d round(s) of %s (%s) on %s, then up to %d runs in all for a %.0f%% "
        "interval of +-%.0f%%",
        confirm_plan.rounds,
        ", ".join(c.label for c in configs),
        how,
        objective,
        confirm_plan.max_runs,
        100 * rule.level,
        100 * rule.target,
    )
    stop = PairStop(
        rule.direction,
        rule.target,
        confirm_plan.rounds,
        protected=frozenset(c.label for c in cands if c.same_training),
        level=rule.level,
    )
    budget = Budget(max(confirm_plan.max_runs, confirm_plan.runs))
    done = comparison.compare(
        [c.label for c in cands],
        base.label,
        budget,
        stop,
        executor,
        report=lambda r, _: log.info(
            "confirmation run %d (round %d) %s: %s",
            r.job + 1,
            r.round + 1,
            r.label,
            f"{objective}={r.value:.4g}" if r.value is not None else r.measurement.status,
        ),
        load=load,
    )
    for cfg in configs:
        readings = done.of(cfg.label)
        cfg.confirm_statuses += [r.measurement.status for r in readings]
        cfg.confirm_values += [r.value for r in readings if r.value is not None]
        cfg.confirm_rounds += [r.round for r in readings if r.value is not None]
    return done


def fresh_process_runs(
    measure: Callable[[list[str], int], Any],
    lean: Sequence[str],
    configs: Sequence[ConfirmedConfig],
) -> Executor:
    """The executor of fresh-process rounds: one run of a config through the sweep's launcher,
    with the lean overrides, in its own subdirectory."""
    by_label = {c.label: c for c in configs}

    def measure_config(label: str, job: int, so_far: Compared) -> Measurement:
        subdir = f"hydra.sweep.subdir=confirm/{job:02d}_{label}"
        overrides = with_overrides(by_label[label].overrides, [*lean, subdir])
        return Measurement.of(measure(overrides, FIRST_CONFIRM_JOB + job))

    return measure_config


def elsewhere(
    study: Any,
    confirmation: Confirmation | None,
    directions: list[str],
    settings: ConfirmOptions,
    n_trials: int,
) -> Pending | None:
    """Where this study's result is made, when not in this worker and not yet final (None: here,
    or done): another worker holds the confirmation's claim for these trials, or still runs
    trials. A worker that does not confirm publishes the best so far, marked pending, never a
    best.yaml of its own: the confirming worker may overturn it."""
    trials = study.get_trials(deepcopy=False)
    counted = sum(1 for t in trials if owners.counted(t))
    if confirmation is not None and confirmation.after_trials == counted:
        return None  # final for these trials
    _, ranked, _ = candidates(trials, directions)  # whether these trials get a round
    confirms = (
        bool(ranked)
        and not plain_names(study.user_attrs.get(STUDY_OBJECTIVES))
        and plan(settings.top_k, settings.rounds, settings.max_share, n_trials, len(ranked))
        is not None
    )
    claim = owners.live_claim(study, counted) if confirms else None
    if claim is not None and claim.get("owner") not in (None, owners.this_owner()):
        name = owners.worker_name(claim["owner"])
        return Pending((name,), f"the confirmation runs in worker {name}")
    holders = owners.running_elsewhere(trials)
    others = tuple(sorted({owners.worker_name(t.system_attrs.get(ATTR_OWNER)) for t in holders}))
    if not others:
        return None
    then = "confirms and " if confirms else ""
    return Pending(
        others,
        f"trials still run in {', '.join(others)}: the last worker to finish {then}writes the "
        "sweep's result (its summary and best.yaml)",
    )
