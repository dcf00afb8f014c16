"""The confirmation round: re-measure the baseline and the top candidates, interleaved, in pairs.

`confirm_if_last` runs it at the end of a sweep: which trials are candidates (`candidates`), how
many runs the budget allows (`plan`), the interleaved rounds with their two-stage stop
(`run_rounds`), and the verdict (`compare`; the winner rule, `winner`, is schema.py's: the best
pick reads it).

Throughput of one configuration drifts 4-14% between fresh processes on these machines, so the
sweep's single measurement per configuration can crown a lucky one. At the end, the baseline (A)
and the top-k candidates (B1, B2, ...) run again as A B1 B2, B2 B1 A, ..., each run a fresh
process (the sweep's launcher: a long-lived process reads 10-35% faster, so in-process numbers must
never meet fresh-process ones). The sweep's own measurement of a candidate is left out: it was
picked for being high (on a 2-core CPU that bias let the sweeper recommend a candidate ~5% slower
than the baseline, docs/benchmarks.md, "Speedup over PyTorch defaults").

The estimator is paired: each round gives one log-ratio log(B/A) of runs made next to each other,
so the machine's slow drift (load from other work) cancels within the pair; the speedup is
exp(mean log-ratio) with a t-interval on the log scale, back-transformed. How many rounds: Stein's
two-stage procedure (`gpuopt.core.stats.stein_pairs`) - `confirm.rounds` first, then as many as the
first rounds' spread says the interval needs to reach +-`confirm.target_halfwidth`, up to the
`confirm.max_share` cap; a candidate leaves the rounds once it has its pairs. Runs are lean where
the objective allows (`lean_overrides`): no compute-ceiling replay, FLOP count, loader pricing.

Verdicts (`verdict`): faster / slower (the interval excludes 1.0x), same (it includes 1.0x and is
within the target: no difference worth having), too noisy (it includes 1.0x and is wider than the
target: this machine, at this load, cannot tell; the record keeps the spread and the load seen).
The winner (`winner`) is the candidate with the highest speedup among those measurably faster than
the baseline; when none is - "same" or "too noisy" - the baseline wins: "keep your configuration".
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuopt.core._compat import storage_of
from gpuopt.core.host import cpu_ticks, steal_percent
from gpuopt.core.stats import mean_interval, stein_pairs, t_quantile
from gpuopt.study.rules import (
    ATTR_BASELINE,
    ATTR_OVERRIDES,
    CONFIRM_CLAIM_ATTR,
    STUDY_CONFIRMATION,
    STUDY_OBJECTIVES,
    feasible_trials,
    plain_names,
    same_training,
    winner,
)
from gpuopt.sweeper import resume
from gpuopt.sweeper.confirm import in_process

log = logging.getLogger("gpuopt.sweeper")

__all__ = [
    "KEEP_BASELINE",
    "compare",
    "lean_overrides",
    "plan",
    "round_order",
    "schedule",
    "speedup",
    "verdict",
    "winner",
]

FASTER, SLOWER, SAME, TOO_NOISY = "faster", "slower", "same", "too noisy"
DEFAULT_TARGET = 0.10  # ConfirmOptions.target_halfwidth's default

# ---- the paired speedup with a confidence interval --------------------------------------------


@dataclass
class Speedup:
    """How much better `candidate` is than `reference` on one metric (ratio > 1: better), from
    per-round pairs."""

    ratio: float
    ci_low: float | None  # None: fewer than 2 pairs
    ci_high: float | None
    n_candidate: int  # measurements on each side (a side may have more than the pairs)
    n_reference: int
    n_pairs: int = 0  # rounds with a measurement on both sides: the estimate's sample
    log_sd: float | None = None  # spread (sd) of the per-round log-ratios
    halfwidth: float | None = None  # relative: (ci_high - ci_low) / (2 * ratio)
    verdict: str | None = None  # faster | slower | same | too noisy; None without an interval
    pairs_needed: int | None = None  # pairs for +-target at this spread (Stein)

    @property
    def distinguishable(self) -> bool | None:
        """Whether the 95% CI excludes 1 (no difference); None when there is no CI."""
        if self.ci_low is None or self.ci_high is None:
            return None
        return self.ci_low > 1.0 or self.ci_high < 1.0


def log_ratios(
    candidate: Sequence[float | None], reference: Sequence[float | None], direction: str
) -> list[float]:
    """log(candidate / reference) per round (position), rounds missing either side left out; the
    sign is flipped for a minimized metric, so > 0 always means "candidate is better"."""
    sign = 1.0 if direction == "maximize" else -1.0
    return [
        sign * (math.log(c) - math.log(r))
        for c, r in zip(candidate, reference, strict=False)
        if _positive(c) and _positive(r)
    ]


def speedup(
    candidate: Sequence[float | None],
    reference: Sequence[float | None],
    direction: str = "maximize",
    confidence: float = 0.95,
    target: float = DEFAULT_TARGET,
    first_stage: int | None = None,
) -> Speedup:
    """Paired speedup of candidate over reference; entry i of each is round i (None: no value).

    exp(mean log-ratio) with a t-interval on the log scale. With `first_stage` (the rounds run
    before the number of rounds was chosen from their spread) the interval is Stein's: the first
    stage's sd with its df, over all pairs - the one that keeps its coverage after that choice.
    """
    d = log_ratios(candidate, reference, direction)
    n_c, n_r = sum(map(_positive, candidate)), sum(map(_positive, reference))
    if not d:
        raise ValueError("speedup needs at least one round with a positive measurement each")
    mean = math.fsum(d) / len(d)
    if len(d) < 2:
        return Speedup(math.exp(mean), None, None, n_c, n_r, n_pairs=1)
    _, half, sd = mean_interval(d, confidence)
    first = len(d) if first_stage is None or not 2 <= first_stage < len(d) else first_stage
    if first < len(d):
        _, _, sd = mean_interval(d[:first], confidence)
        half = t_quantile(0.5 + confidence / 2.0, first - 1) * sd / math.sqrt(len(d))
    low, high = _exp(mean - half), _exp(mean + half)
    halfwidth = math.sinh(min(half, 700.0))
    return Speedup(
        ratio=math.exp(mean),
        ci_low=low,
        ci_high=high,
        n_candidate=n_c,
        n_reference=n_r,
        n_pairs=len(d),
        log_sd=sd,
        halfwidth=halfwidth,
        verdict=verdict(low, high, halfwidth, target),
        pairs_needed=stein_pairs(sd, first, math.asinh(target), confidence),
    )


def verdict(ci_low: float, ci_high: float, halfwidth: float, target: float) -> str:
    """faster / slower when the interval excludes 1.0x (however wide: the sign is established);
    else same when it is within +-target, too noisy when it is not."""
    if ci_low > 1.0:
        return FASTER
    if ci_high < 1.0:
        return SLOWER
    return SAME if halfwidth <= target else TOO_NOISY


def _positive(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def _exp(x: float) -> float:
    return math.exp(max(-700.0, min(700.0, x)))


# ---- planning and recording ------------------------------------------------------------------


@dataclass(frozen=True)
class ConfirmPlan:
    top_k: int
    rounds: int  # the first stage: rounds before the spread decides how many more
    max_runs: int = 0  # the cap on all confirmation runs (0: the first stage only)

    @property
    def runs(self) -> int:
        """Runs of the first stage."""
        return self.rounds * (self.top_k + 1)


def plan(
    top_k: int, rounds: int, max_share: float, n_trials: int, n_candidates: int
) -> ConfirmPlan | None:
    """Size the round to at most max_share * n_trials runs. An interval needs 2 pairs, so
    candidates are dropped (the weakest first) until the first stage (`rounds`, at least 2) fits;
    the rest of the cap is for the second stage.

    None when it is off (rounds=0 or top_k=0), there is nothing to confirm, or the cap does not
    allow two rounds of the baseline and one candidate.
    """
    k = min(top_k, n_candidates)
    if rounds <= 0 or k <= 0:
        return None
    budget = math.floor(max_share * n_trials + 1e-9)
    while k > 1 and (k + 1) * max(rounds, 2) > budget:
        k -= 1
    if 2 * (k + 1) > budget:
        return None
    return ConfirmPlan(top_k=k, rounds=max(2, min(rounds, budget // (k + 1))), max_runs=budget)


def round_order(labels: Sequence[str], round_index: int) -> list[str]:
    """A B1 B2 in even rounds, B2 B1 A in odd ones, so a position effect (the first run of a
    round, or the one after a given config) does not favour one config. In a fixed order a
    benchmark read -13% in 5 of 5 rounds between two timings that agreed within 1.1% once the
    order alternated (docs/benchmarks.md). The benchmarks in scripts/ use the same order."""
    return list(labels) if round_index % 2 == 0 else list(reversed(labels))


def schedule(labels: Sequence[str], rounds: int) -> list[str]:
    """Every round measures each config once, in `round_order`: A B1 B2 B2 B1 A A B1 B2 ..."""
    return [label for r in range(rounds) for label in round_order(labels, r)]


# Objectives read from the timed window (and the epoch boundary) alone: for these the confirmation
# runs skip the extras measured beside the window. Any other objective keeps every measurement.
WINDOW_OBJECTIVES = frozenset({"throughput", "throughput_amortized", "step_time_ms"})
LEAN_MEASURE = (
    "measure.ceiling=false",
    "measure.count_flops=false",
    "measure.peak_probe=false",
    "measure.loader_cost=false",
)


def lean_overrides(objective: str, config: Any) -> list[str]:
    """The measure.* overrides that shorten a confirmation run without changing its objective:
    more pairs in the same time. Both sides of every pair get them, so the ratio stays fair. Only
    where the trial's resolved `config` has those keys (a task of its own may not)."""
    measure = config.get("measure") if isinstance(config, dict) else None
    keys = [o.split("=", 1)[0].split(".", 1)[1] for o in LEAN_MEASURE]
    if objective not in WINDOW_OBJECTIVES or not isinstance(measure, dict):
        return []
    return list(LEAN_MEASURE) if all(k in measure for k in keys) else []


def with_overrides(overrides: Sequence[str], extra: Sequence[str]) -> list[str]:
    """`overrides` with `extra` added, an extra replacing an override of the same key."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys] + list(extra)


@dataclass
class ConfirmedConfig:
    label: str  # "baseline", "candidate1", ...
    trial_number: int
    params: dict[str, Any]
    overrides: list[str]
    sweep_values: list[float]  # first-objective values of the study's trials with these params
    confirm_values: list[float] = field(default_factory=list)
    confirm_statuses: list[str] = field(default_factory=list)
    # round of each confirm_values entry (empty: value i is round i); a failed run has no value
    confirm_rounds: list[int] = field(default_factory=list)
    same_training: bool = False  # keeps the baseline's training math (schema.same_training)

    def by_round(self) -> dict[int, float]:
        rounds = self.confirm_rounds or range(len(self.confirm_values))
        return dict(zip(rounds, self.confirm_values, strict=False))


KEEP_BASELINE = "no candidate is measurably faster than the baseline: keep your configuration"


def paired(
    cand: ConfirmedConfig, ref: ConfirmedConfig, direction: str, **kwargs: Any
) -> dict[str, Any]:
    """`speedup` of cand over ref from the rounds both ran, as a record entry."""
    a, b = cand.by_round(), ref.by_round()
    rounds = sorted(set(a) | set(b))
    if kwargs.get("first_stage"):  # Stein's first stage: the pairs of the first rounds
        kwargs["first_stage"] = sum(
            1 for r in rounds if r < kwargs["first_stage"] and r in a and r in b
        )
    try:
        s = speedup([a.get(r) for r in rounds], [b.get(r) for r in rounds], direction, **kwargs)
    except ValueError as exc:
        return {"error": str(exc)}
    return {**asdict(s), "distinguishable": s.distinguishable}


def compare(
    configs: Sequence[ConfirmedConfig],
    direction: str,
    target: float = DEFAULT_TARGET,
    first_stage: int | None = None,
    loads: Sequence[float] = (),
    steal_pct: float | None = None,
) -> dict[str, Any]:
    """Paired speedups over the baseline and whether the top two candidates can be told apart,
    from the re-measurements (the module docstring says why not the sweep's). `loads`: the 1-min
    load averages seen before the runs and `steal_pct` the CPU time the hypervisor took over them,
    kept on each entry for a "too noisy" verdict."""
    base = configs[0]
    seen: dict[str, Any] = {"target_halfwidth": target}
    if loads:
        seen.update(load_1m=[min(loads), max(loads)], cpus=_cpus())
    if steal_pct is not None:
        seen.update(steal_pct=steal_pct)
    out: dict[str, Any] = {"comparisons": [], "top_two": None}
    for cand in configs[1:]:
        entry = {"label": cand.label, "trial_number": cand.trial_number}
        entry.update(paired(cand, base, direction, target=target, first_stage=first_stage))
        out["comparisons"].append({**entry, **seen})
    if len(configs) >= 3:
        a, b = configs[1], configs[2]
        # no first stage here: the rounds were not chosen from this pair's spread
        out["top_two"] = {"labels": [a.label, b.label], **paired(a, b, direction, target=target)}
    return out


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
    target_halfwidth: float = DEFAULT_TARGET,
    compose: Callable[[list[str]], Any] | None = None,
    in_process: bool = False,
    window_s: float = 1.0,
) -> dict[str, Any] | None:
    """Plan, claim and run the round; store and return its record (None when it does not run).

    `measure(overrides, index)` runs one configuration in a fresh process and returns its
    TrialOutcome. With `in_process` and `compose(overrides)` (the sweep's composition of a job's
    config), configurations that can share a process are measured in alternating windows of one
    process instead (gpuopt/sweeper/confirm/in_process.py).
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
                "confirmation round skipped: %.0f%% of n_trials=%d allows fewer than 2 rounds "
                "(hydra.sweeper.confirm.max_share)",
                100 * max_share,
                n_trials,
            )
        return None
    if not resume.claim_confirmation(study, counted):
        log.info("another worker runs the confirmation round")
        return previous if isinstance(previous, dict) else None
    rule = StopRule(directions[0], target_halfwidth)
    measured = None
    if in_process and compose is not None and names[0] in WINDOW_OBJECTIVES:
        # windows are cheap: the top_k asked for, not the fresh-process cap's
        chosen = [baseline, *ranked[:top_k]]
        measured = in_process_rounds(
            chosen, feasible, confirm_plan, names[0], rule, compose, window_s, sweep_dir
        )
    if measured is None:
        chosen = [baseline, *ranked[: confirm_plan.top_k]]
        lean = lean_overrides(names[0], baseline.user_attrs.get("config"))
        configs = confirmed_configs(chosen, feasible)
        done = run_rounds(configs, confirm_plan, names[0], fresh_process_runs(measure, lean), rule)
        mode = {"mode": "fresh processes"}
        measured = Measured(names[0], configs, confirm_plan, done, mode, lean)
    record = json.loads(json.dumps(measured.record(rule, counted, sweep_dir), default=str))
    study.set_user_attr(STUDY_CONFIRMATION, record)
    return record


def labels(chosen: Sequence[Any]) -> list[str]:
    """baseline, candidate1, candidate2, ... for the baseline and the chosen candidates."""
    return ["baseline" if i == 0 else f"candidate{i}" for i in range(len(chosen))]


def confirmed_configs(chosen: Sequence[Any], feasible: Sequence[Any]) -> list[ConfirmedConfig]:
    """The record of each chosen trial (the baseline first), its sweep values beside it."""
    return [
        ConfirmedConfig(
            label=label,
            trial_number=t.number,
            params=dict(t.params),
            overrides=list(t.user_attrs.get(ATTR_OVERRIDES) or []),
            sweep_values=[s.values[0] for s in feasible if _key(s.params) == _key(t.params)],
            same_training=same_training(t, chosen[0]),
        )
        for label, t in zip(labels(chosen), chosen, strict=True)
    ]


@dataclass
class Measured:
    """The rounds as run: the objective, the configs with their values, the plan they ran under,
    the count, how they were measured (the record's "mode" keys) and fresh runs' lean overrides."""

    objective: str
    configs: list[ConfirmedConfig]
    plan: ConfirmPlan
    done: RoundsDone
    mode: dict[str, Any]
    lean: list[str] = field(default_factory=list)

    def record(self, rule: StopRule, after_trials: int, sweep_dir: str) -> dict[str, Any]:
        """The confirmation's record (the study's user attr): how it ran and its comparisons."""
        done, configs, first = self.done, self.configs, self.plan.rounds
        return {
            "objective": self.objective,
            "direction": rule.direction,
            **self.mode,
            "rounds": done.rounds,
            "first_stage": first,
            "max_runs": self.plan.max_runs,
            "runs": done.runs,
            "target_halfwidth": rule.target,
            "estimator": "paired log-ratio, Stein two-stage t-interval",
            "lean_overrides": self.lean,
            "loads": done.loads,
            "top_k": self.plan.top_k,
            "after_trials": after_trials,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "sweep_dir": sweep_dir,
            "configs": [vars(c) for c in configs],
            "steal_pct": done.steal_pct,
            **compare(configs, rule.direction, rule.target, first, done.loads, done.steal_pct),
        }


def in_process_rounds(
    chosen: Sequence[Any],
    feasible: Sequence[Any],
    fresh_plan: ConfirmPlan,
    objective: str,
    rule: StopRule,
    compose: Callable[[list[str]], Any],
    window_s: float,
    sweep_dir: str,
) -> Measured | None:
    """The rounds as alternating windows of one shared process (gpuopt/sweeper/confirm/in_process.py),
    within the fresh-process plan's time; None when the chosen trials cannot share one."""
    shared = in_process.open_shared(
        chosen, labels(chosen), compose, objective, window_s, Path(sweep_dir) / "confirm"
    )
    if shared is None:
        return None
    first, cap = in_process.window_plan(
        fresh_plan.rounds,
        fresh_plan.max_runs,
        trial_seconds(feasible),
        [in_process.window_seconds(t, window_s) for t in chosen],
    )
    window_plan = ConfirmPlan(len(chosen) - 1, first, cap)
    configs = confirmed_configs(chosen, feasible)
    try:
        done = run_rounds(
            configs,
            window_plan,
            objective,
            lambda cfg, job: shared.window(cfg.label),
            rule,
            how=f"alternating {window_s:g} s windows in one process",
        )
    finally:
        shared.close()
    mode = {"mode": "in-process windows", "window_s": window_s}
    return Measured(objective, configs, window_plan, done, mode)


def trial_seconds(trials: Sequence[Any]) -> list[float]:
    """How long each finished trial took (its process, as the launcher ran it)."""
    return [
        (t.datetime_complete - t.datetime_start).total_seconds()
        for t in trials
        if t.datetime_start is not None and t.datetime_complete is not None
    ]


# Job numbers of the confirmation runs (the sweep's trials are numbered from 0).
FIRST_CONFIRM_JOB = 10_000


@dataclass(frozen=True)
class StopRule:
    """When a candidate has its pairs: after the first stage, Stein's count for +-target."""

    direction: str
    target: float

    def pairs(self, cand: ConfirmedConfig, base: ConfirmedConfig, first: int) -> int:
        """Total pairs for cand, from the spread of its first-stage pairs (no more rounds when
        fewer than 2 pairs were measured: the runs fail, more would not help)."""
        a, b = cand.by_round(), base.by_round()
        d = log_ratios(
            [a.get(r) for r in range(first)], [b.get(r) for r in range(first)], self.direction
        )
        if len(d) < 2:
            return first
        n = stein_pairs(mean_interval(d)[2], len(d), math.asinh(self.target))
        return first + (n - len(d)) + (n - len(d)) % 2  # whole A B / B A cycles: balanced order


@dataclass
class RoundsDone:
    rounds: int
    runs: int
    loads: list[float]
    steal_pct: float | None = None  # the hypervisor's share of the CPU over the rounds (host.py)


def run_rounds(
    configs: Sequence[ConfirmedConfig],
    confirm_plan: ConfirmPlan,
    objective: str,
    measure_config: Callable[[ConfirmedConfig, int], Any],
    rule: StopRule,
    load: Callable[[], float] = lambda: os.getloadavg()[0],
    how: str = "interleaved, fresh processes",
) -> RoundsDone:
    """The first stage (every config, `confirm_plan.rounds` rounds), then each candidate for as
    many rounds as `rule` gives it, with the baseline, while the run cap allows a whole round.
    `measure_config(cfg, job)` measures cfg once (a fresh-process run, or an in-process window)."""
    base, cands = configs[0], list(configs[1:])
    first = confirm_plan.rounds
    wanted = {c.label: first for c in cands}
    by_label = {c.label: c for c in configs}
    log.info(
        "confirmation: %d round(s) of %s (%s) on %s, then up to %d runs in all for +-%.0f%%",
        first,
        ", ".join(c.label for c in configs),
        how,
        objective,
        confirm_plan.max_runs,
        100 * rule.target,
    )
    runs, r, loads, ticks = 0, 0, [], cpu_ticks()
    while active := [c for c in cands if r < wanted[c.label]]:
        if runs + len(active) + 1 > max(confirm_plan.max_runs, confirm_plan.runs):
            log.info("confirmation: the run cap (%d, confirm.max_share) is reached", runs)
            break
        for label in round_order([base.label, *(c.label for c in active)], r):
            cfg = by_label[label]
            loads.append(load())
            _measure_one(cfg, r, runs, objective, measure_config)
            runs += 1
        r += 1
        if r == first:
            wanted = {c.label: rule.pairs(c, base, first) for c in cands}
            log.info(
                "confirmation: rounds wanted for +-%.0f%%: %s",
                100 * rule.target,
                ", ".join(f"{k} {v}" for k, v in wanted.items()),
            )
    steal = steal_percent(ticks, cpu_ticks())
    return RoundsDone(rounds=r, runs=runs, loads=loads, steal_pct=steal)


def fresh_process_runs(
    measure: Callable[[list[str], int], Any], lean: Sequence[str]
) -> Callable[[ConfirmedConfig, int], Any]:
    """`measure_config(cfg, job)` for run_rounds: one fresh-process run of cfg through the sweep's
    launcher (`measure(overrides, job)`), with the lean overrides, in its own subdirectory."""

    def measure_config(cfg: ConfirmedConfig, job: int) -> Any:
        subdir = f"hydra.sweep.subdir=confirm/{job:02d}_{cfg.label}"
        return measure(with_overrides(cfg.overrides, [*lean, subdir]), FIRST_CONFIRM_JOB + job)

    return measure_config


def _measure_one(
    cfg: ConfirmedConfig,
    round_index: int,
    job: int,
    objective: str,
    measure_config: Callable[[ConfirmedConfig, int], Any],
) -> None:
    """One measurement of cfg; its value (or status) recorded under round_index."""
    outcome = measure_config(cfg, job)
    cfg.confirm_statuses.append(outcome.status)
    measured = outcome.feasible and outcome.values
    if measured:
        cfg.confirm_values.append(outcome.values[0])
        cfg.confirm_rounds.append(round_index)
    log.info(
        "confirmation run %d (round %d) %s: %s",
        job + 1,
        round_index + 1,
        cfg.label,
        f"{objective}={outcome.values[0]:.4g}" if measured else outcome.status,
    )


def _key(params: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def elsewhere(
    study: Any,
    confirmation: dict[str, Any] | None,
    directions: list[str],
    settings: Any,
    n_trials: int,
) -> str | None:
    """Where the confirmation of this study's trials runs, when not in this worker and not yet
    done (None: it ran here, is done, or will not run). A worker that does not confirm must
    not publish a best of its own: the confirming worker may overturn it. `settings`: the
    sweeper's ConfirmOptions."""
    trials = study.get_trials(deepcopy=False)
    counted = sum(1 for t in trials if resume.counted(t))
    if confirmation and confirmation.get("after_trials") == counted:
        return None  # final for these trials
    _, ranked, _ = candidates(trials, directions)
    if plain_names(study.user_attrs.get(STUDY_OBJECTIVES)) or not ranked:
        return None
    if plan(settings.top_k, settings.rounds, settings.max_share, n_trials, len(ranked)) is None:
        return None
    me = resume.this_owner()
    claim = storage_of(study).get_study_system_attrs(resume.study_id(study))
    claim = claim.get(CONFIRM_CLAIM_ATTR)
    if (
        isinstance(claim, dict)
        and claim.get("after_trials") == counted
        and claim.get("owner") not in (None, me)
        and resume.owner_alive(claim.get("owner")) is not False
    ):
        owner = claim["owner"]
        return f"the confirmation runs in worker {owner.get('host')}:{owner.get('pid')}"
    others = {
        f"{o.get('host')}:{o.get('pid')}"
        for t in resume.in_flight(trials)
        if (o := t.system_attrs.get(resume.OWNER_ATTR) or {}) != me
    }
    if not others:
        return None
    return (
        f"the confirmation runs in the last worker to finish ({', '.join(sorted(others))}); "
        "its summary and best.yaml are the sweep's result"
    )
