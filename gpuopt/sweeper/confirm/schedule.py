"""What the confirmation re-measures (`candidates`), and how many runs it may make (`plan`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuopt.core.metrics import window_metrics
from gpuopt.study.keys import ATTR_BASELINE, ATTR_OVERRIDES
from gpuopt.study.records import ConfirmedConfig
from gpuopt.study.rules import feasible_trials, same_training


def candidates(
    trials: Sequence[Any], directions: Sequence[str]
) -> tuple[Any | None, list[Any], list[Any]]:
    """(the feasible baseline, the others best first, one per distinct params and none with the
    baseline's, every feasible trial)."""
    feasible = feasible_trials(trials)
    baseline = next((t for t in feasible if t.user_attrs.get(ATTR_BASELINE)), None)
    if baseline is None:
        return None, [], feasible
    sign = 1 if directions[0] == "maximize" else -1
    seen = {params_key(baseline.params)}
    chosen = []
    others = (t for t in feasible if not t.user_attrs.get(ATTR_BASELINE))
    for t in sorted(others, key=lambda t: -sign * t.values[0]):
        if params_key(t.params) not in seen:
            seen.add(params_key(t.params))
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


def answers_among(ranked: Sequence[Any], baseline: Any) -> int:
    """How many of the first candidates `plan` must keep so that both answers are confirmed."""
    same = next((i for i, t in enumerate(ranked) if same_training(t, baseline)), None)
    return 1 if same is None else min(same + 1, 2)


@dataclass(frozen=True)
class ConfirmPlan:
    top_k: int
    rounds: int  # the first stage: rounds before the spread decides how many more
    max_runs: int = 0  # the cap on all confirmation runs (0: the first stage only)

    @property
    def runs(self) -> int:  # of the first stage
        return self.rounds * (self.top_k + 1)


def plan(
    top_k: int,
    rounds: int,
    max_share: float,
    n_trials: int,
    n_candidates: int,
    keep: int = 1,
) -> ConfirmPlan | None:
    """Size the round to at most max_share * n_trials runs: candidates dropped (the weakest
    first) until the first stage (`rounds`, at least 2: an interval needs 2 pairs) fits, the first
    `keep` only where not even 2 rounds of them fit. None when it is off, there is nothing to
    confirm, or the cap does not allow two rounds of the baseline and one candidate."""
    k = min(top_k, n_candidates)
    if rounds <= 0 or k <= 0:
        return None
    budget = math.floor(max_share * n_trials + 1e-9)
    while k > max(1, min(keep, k)) and (k + 1) * max(rounds, 2) > budget:
        k -= 1
    while k > 1 and 2 * (k + 1) > budget:
        k -= 1
    if 2 * (k + 1) > budget:
        return None
    return ConfirmPlan(top_k=k, rounds=max(2, min(rounds, budget // (k + 1))), max_runs=budget)


# Objectives read from the timed window (and the epoch boundary) alone: for these the confirmation
# runs skip the extras measured beside the window.
WINDOW_OBJECTIVES = window_metrics()
LEAN_MEASURE = (
    "measure.ceiling=false",
    "measure.count_flops=false",
    "measure.peak_probe=false",
    "measure.loader_cost=false",
)


def lean_overrides(objective: str, config: Any) -> list[str]:
    """The measure.* overrides that shorten a confirmation run without changing its objective
    (both sides of every pair get them), where the resolved `config` has those keys."""
    measure = config.get("measure") if isinstance(config, dict) else None
    keys = [o.split("=", 1)[0].split(".", 1)[1] for o in LEAN_MEASURE]
    if objective not in WINDOW_OBJECTIVES or not isinstance(measure, dict):
        return []
    return list(LEAN_MEASURE) if all(k in measure for k in keys) else []


def with_overrides(overrides: Sequence[str], extra: Sequence[str]) -> list[str]:
    """`overrides` with `extra` added, an extra replacing an override of the same key."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys] + list(extra)


def labels(chosen: Sequence[Any]) -> list[str]:
    """baseline, candidate1, candidate2, ..."""
    return ["baseline" if i == 0 else f"candidate{i}" for i in range(len(chosen))]


def confirmed_configs(chosen: Sequence[Any]) -> list[ConfirmedConfig]:
    """The record of each chosen trial (the baseline first)."""
    return [
        ConfirmedConfig(
            label=label,
            trial_number=t.number,
            params=dict(t.params),
            overrides=list(t.user_attrs.get(ATTR_OVERRIDES) or []),
            same_training=same_training(t, chosen[0]),
        )
        for label, t in zip(labels(chosen), chosen, strict=True)
    ]


def params_key(params: dict[str, Any]) -> tuple:
    """Trials with the same params are one configuration."""
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


@dataclass(frozen=True)
class Pending:
    """The sweep's result comes from other workers: `workers` (host:pid) and why, in words."""

    workers: tuple[str, ...]
    text: str

    @property
    def worker(self) -> str:
        """The `pending` field of optimization_results.yaml."""
        return ", ".join(self.workers)
