"""The confirmation round: re-measure the baseline and the top candidates, interleaved.

`confirm_if_last` runs it at the end of a sweep: which trials are candidates (`candidates`), how
many runs the budget allows (`plan`), the interleaved rounds (`schedule`, `run_rounds`), and the
verdict (`compare`; the winner rule, `winner`, is schema.py's: the best pick reads it).

Throughput of one configuration drifts 4-14% between fresh processes on these machines, so the
sweep's single measurement per configuration can crown a lucky one. At the end, the baseline (A)
and the top-k candidates (B1, B2, ...) run again as A B1 B2 B2 B1 A ..., and the speedup of each
candidate over the baseline is estimated from those re-measurements only, with a 95% confidence
interval on the log-ratio of means (Welch's t: unequal variances, small samples). The sweep's own
measurement of a candidate is left out: it was picked for being high. On a 2-core CPU that bias,
with a fixed run order, let the sweeper recommend a candidate ~5% slower than the baseline
(docs/benchmarks.md, "Speedup over PyTorch defaults").

The winner (`winner`) is the candidate with the highest speedup among those measurably faster
than the baseline (the CI above 1.0x, or no CI possible and a speedup > 1); when none is, the
baseline wins: "keep your configuration" is the honest answer to a gain the noise can explain.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuopt.stats import t_quantile

from . import resume
from .schema import (
    ATTR_BASELINE,
    ATTR_OVERRIDES,
    STUDY_CONFIRMATION,
    STUDY_OBJECTIVES,
    feasible_trials,
    plain_names,
    same_training,
    winner,
)

log = logging.getLogger("gpuopt.sweeper")

__all__ = ["KEEP_BASELINE", "compare", "plan", "round_order", "schedule", "speedup", "winner"]

# ---- speedup with a confidence interval -------------------------------------------------------


@dataclass
class Speedup:
    """How much better `candidate` is than `reference` on one metric (ratio > 1: better)."""

    ratio: float
    ci_low: float | None  # None: fewer than 2 measurements on a side
    ci_high: float | None
    n_candidate: int
    n_reference: int

    @property
    def distinguishable(self) -> bool | None:
        """Whether the 95% CI excludes 1 (no difference); None when there is no CI."""
        if self.ci_low is None or self.ci_high is None:
            return None
        return self.ci_low > 1.0 or self.ci_high < 1.0


def speedup(
    candidate: Sequence[float],
    reference: Sequence[float],
    direction: str = "maximize",
    confidence: float = 0.95,
) -> Speedup:
    """Speedup of candidate over reference from all measurements of each.

    Works on logs (throughput is a rate: its noise is multiplicative): the estimate is
    exp(mean log c - mean log r), the CI uses Welch's standard error and Welch-Satterthwaite df.
    For a minimized metric the ratio is inverted, so > 1 always means "candidate is better".
    """
    c = [math.log(v) for v in candidate if v is not None and v > 0 and math.isfinite(v)]
    r = [math.log(v) for v in reference if v is not None and v > 0 and math.isfinite(v)]
    if not c or not r:
        raise ValueError("speedup needs at least one positive measurement on each side")
    sign = 1.0 if direction == "maximize" else -1.0
    diff = sign * (statistics.fmean(c) - statistics.fmean(r))
    if len(c) < 2 or len(r) < 2:
        return Speedup(math.exp(diff), None, None, len(c), len(r))
    vc, vr = statistics.variance(c) / len(c), statistics.variance(r) / len(r)
    se = math.sqrt(vc + vr)
    if se == 0.0:
        return Speedup(math.exp(diff), math.exp(diff), math.exp(diff), len(c), len(r))
    df = (vc + vr) ** 2 / ((vc * vc) / (len(c) - 1) + (vr * vr) / (len(r) - 1))
    half = t_quantile(0.5 + confidence / 2.0, df) * se
    return Speedup(math.exp(diff), math.exp(diff - half), math.exp(diff + half), len(c), len(r))


# ---- planning and recording ------------------------------------------------------------------


@dataclass(frozen=True)
class ConfirmPlan:
    top_k: int
    rounds: int

    @property
    def runs(self) -> int:
        return self.rounds * (self.top_k + 1)


def plan(
    top_k: int, rounds: int, max_share: float, n_trials: int, n_candidates: int
) -> ConfirmPlan | None:
    """Size the round to at most max_share * n_trials runs. A confidence interval needs repeats,
    so candidates are dropped (the weakest first) until two rounds fit; then rounds grow.

    None when it is off (rounds=0 or top_k=0), there is nothing to confirm, or the cap does not
    allow even one baseline + one candidate run.
    """
    k = min(top_k, n_candidates)
    if rounds <= 0 or k <= 0:
        return None
    budget = math.floor(max_share * n_trials + 1e-9)
    while k > 1 and (k + 1) * min(rounds, 2) > budget:
        k -= 1
    if (k + 1) > budget:
        return None
    return ConfirmPlan(top_k=k, rounds=max(1, min(rounds, budget // (k + 1))))


def round_order(labels: Sequence[str], round_index: int) -> list[str]:
    """A B1 B2 in even rounds, B2 B1 A in odd ones, so a position effect (the first run of a
    round, or the one after a given config) does not favour one config. In a fixed order a
    benchmark read -13% in 5 of 5 rounds between two timings that agreed within 1.1% once the
    order alternated (docs/benchmarks.md). The benchmarks in scripts/ use the same order."""
    return list(labels) if round_index % 2 == 0 else list(reversed(labels))


def schedule(labels: Sequence[str], rounds: int) -> list[str]:
    """Every round measures each config once, in `round_order`: A B1 B2 B2 B1 A A B1 B2 ..."""
    return [label for r in range(rounds) for label in round_order(labels, r)]


@dataclass
class ConfirmedConfig:
    label: str  # "baseline", "candidate1", ...
    trial_number: int
    params: dict[str, Any]
    overrides: list[str]
    sweep_values: list[float]  # first-objective values of the study's trials with these params
    confirm_values: list[float] = field(default_factory=list)
    confirm_statuses: list[str] = field(default_factory=list)
    same_training: bool = False  # keeps the baseline's training math (schema.same_training)


KEEP_BASELINE = "no candidate is measurably faster than the baseline: keep your configuration"


def compare(configs: Sequence[ConfirmedConfig], direction: str) -> dict[str, Any]:
    """Speedups over the baseline and whether the top two candidates can be told apart, from the
    re-measurements (the module docstring says why not the sweep's)."""
    base = configs[0]
    out: dict[str, Any] = {"comparisons": [], "top_two": None}
    for cand in configs[1:]:
        entry: dict[str, Any] = {"label": cand.label, "trial_number": cand.trial_number}
        try:
            entry.update(asdict(s := speedup(cand.confirm_values, base.confirm_values, direction)))
            entry["distinguishable"] = s.distinguishable
        except ValueError as exc:
            entry["error"] = str(exc)
        out["comparisons"].append(entry)
    if len(configs) >= 3:
        a, b = configs[1], configs[2]
        try:
            s = speedup(a.confirm_values, b.confirm_values, direction)
            out["top_two"] = {
                "labels": [a.label, b.label],
                **asdict(s),
                "distinguishable": s.distinguishable,
            }
        except ValueError as exc:
            out["top_two"] = {"labels": [a.label, b.label], "error": str(exc)}
    return out


# ---- the round, at the end of a sweep ----------------------------------------------------------


def confirm_if_last(study: Any, **kwargs: Any) -> dict[str, Any] | None:
    """The confirmation round runs in the last worker to finish (the others' trials are done);
    the others return the stored record, if any. kwargs: those of `run`."""
    owner = resume.this_owner()
    others = [
        t
        for t in resume.in_flight(study.get_trials(deepcopy=False))
        if t.system_attrs.get(resume.OWNER_ATTR) != owner
    ]
    if others:
        log.info(
            "%d trial(s) still running in other workers: the last worker to finish runs the "
            "confirmation round",
            len(others),
        )
        previous = study.user_attrs.get(STUDY_CONFIRMATION)
        return previous if isinstance(previous, dict) else None
    return run(study, **kwargs)


def candidates(
    trials: Sequence[Any], directions: Sequence[str]
) -> tuple[Any | None, list[Any], list[Any]]:
    """(the feasible baseline, the other feasible trials best first with one per distinct params
    and none with the baseline's, every feasible trial)."""
    feasible = feasible_trials(trials)
    baseline = next((t for t in feasible if t.user_attrs.get(ATTR_BASELINE)), None)
    if baseline is None:
        return None, [], feasible
    sign = 1 if directions[0] == "maximize" else -1
    seen = {_key(baseline.params)}
    chosen = []
    for t in sorted(
        (t for t in feasible if not t.user_attrs.get(ATTR_BASELINE)),
        key=lambda t: -sign * t.values[0],
    ):
        if _key(t.params) not in seen:
            seen.add(_key(t.params))
            chosen.append(t)
    return baseline, chosen, feasible


def with_same_training_pick(ranked: list[Any], baseline: Any, top_k: int) -> tuple[list[Any], int]:
    """Both answers get their own confirmation: when the best same-training candidate is not in
    the top k, it goes second (top_k at least 2), after the best overall."""
    same = [t for t in ranked if same_training(t, baseline)]
    if not same or same[0] in ranked[:top_k] or not ranked:
        return ranked, top_k
    rest = [t for t in ranked if t is not same[0]]
    return [rest[0], same[0], *rest[1:]], max(top_k, 2)


def run(
    study: Any,
    *,
    names: Sequence[str],
    directions: Sequence[str],
    top_k: int,
    rounds: int,
    max_share: float,
    n_trials: int,
    sweep_dir: str,
    measure: Callable[[list[str], int], Any],
) -> dict[str, Any] | None:
    """Plan, claim and run the round; store and return its record (None when it does not run).

    `measure(overrides, index)` runs one configuration and returns its TrialOutcome.
    """
    if plain_names(study.user_attrs.get(STUDY_OBJECTIVES)):
        return None  # a stock-style task: its values are not noisy measurements to confirm
    all_trials = study.get_trials(deepcopy=False)
    previous = study.user_attrs.get(STUDY_CONFIRMATION)
    counted = sum(1 for t in all_trials if resume.counted(t))
    if previous and previous.get("after_trials") == counted:
        return previous  # nothing new since the last confirmation
    baseline, ranked, feasible = candidates(all_trials, directions)
    if baseline is None:
        return None
    ranked, top_k = with_same_training_pick(ranked, baseline, top_k)
    confirm_plan = plan(top_k, rounds, max_share, n_trials, len(ranked))
    if confirm_plan is None:
        if rounds > 0 and ranked:
            log.info(
                "confirmation round skipped: %.0f%% of n_trials=%d allows fewer than 2 runs "
                "(hydra.sweeper.confirm.max_share)",
                100 * max_share,
                n_trials,
            )
        return None
    if not resume.claim_confirmation(study, counted):
        log.info("another worker runs the confirmation round")
        return previous if isinstance(previous, dict) else None
    configs = [
        ConfirmedConfig(
            label="baseline" if i == 0 else f"candidate{i}",
            trial_number=t.number,
            params=dict(t.params),
            overrides=list(t.user_attrs.get(ATTR_OVERRIDES) or []),
            sweep_values=[s.values[0] for s in feasible if _key(s.params) == _key(t.params)],
            same_training=same_training(t, baseline),
        )
        for i, t in enumerate([baseline, *ranked[: confirm_plan.top_k]])
    ]
    run_rounds(configs, confirm_plan.rounds, names[0], measure)
    record = {
        "objective": names[0],
        "direction": directions[0],
        "rounds": confirm_plan.rounds,
        "top_k": confirm_plan.top_k,
        "after_trials": counted,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sweep_dir": sweep_dir,
        "configs": [vars(c) for c in configs],
        **compare(configs, directions[0]),
    }
    record = json.loads(json.dumps(record, default=str))
    study.set_user_attr(STUDY_CONFIRMATION, record)
    return record


# Job numbers of the confirmation runs (the sweep's trials are numbered from 0).
FIRST_CONFIRM_JOB = 10_000


def run_rounds(
    configs: Sequence[ConfirmedConfig],
    rounds: int,
    objective: str,
    measure: Callable[[list[str], int], Any],
) -> None:
    """Measure every config once per round in `schedule` order; record values and statuses."""
    by_label = {c.label: c for c in configs}
    order = schedule([c.label for c in configs], rounds)
    log.info(
        "confirmation: %d round(s) of %s (interleaved) on %s",
        rounds,
        ", ".join(c.label for c in configs),
        objective,
    )
    for i, label in enumerate(order):
        cfg = by_label[label]
        overrides = [*cfg.overrides, f"hydra.sweep.subdir=confirm/{i:02d}_{label}"]
        outcome = measure(overrides, FIRST_CONFIRM_JOB + i)
        cfg.confirm_statuses.append(outcome.status)
        measured = outcome.feasible and outcome.values
        if measured:
            cfg.confirm_values.append(outcome.values[0])
        log.info(
            "confirmation %d/%d %s: %s",
            i + 1,
            len(order),
            label,
            f"{objective}={outcome.values[0]:.4g}" if measured else outcome.status,
        )


def _key(params: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))
