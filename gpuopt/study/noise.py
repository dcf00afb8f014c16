"""Which trials the measurements cannot tell apart: noise said as noise, never shown as choice.

Fresh processes of one configuration read 4-25% apart on a 2-core CPU (an A/A sweep of eight
trials: 4,397-5,645 samples/s, 7 of them on the Pareto front as "trade-offs"), and a trial's own
`throughput_ci` covers only its one window. So two configurations are apart on an objective only
when their pooled readings differ by more than the 95% quantile x one reading's run-to-run spread
(`spread_of`: measured, else the study's replicates, else DEFAULT_SPREAD) x sqrt(1/n_a + 1/n_b).
Objectives that are not gpuopt metrics (an app's own, deterministic) are compared exactly.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gpuopt.core.fmt import metric as fmt_metric
from gpuopt.core.metrics import goals
from gpuopt.core.stats import t_quantile
from gpuopt.study.keys import ATTR_BASELINE

# One reading's run-to-run spread where nothing measured it: fresh processes of one fixed
# configuration varied 4-14% (CV) on the 2-core development CPUs (docs/benchmarks.md), and an A/A
# sweep read 25% apart; 10% is the middle of that, so two single readings within ~28% of each
# other are "within noise" until a measurement says otherwise.
DEFAULT_SPREAD = 0.10
MIN_REPLICATE_DF = 2  # one replicate pair is one difference: too few to estimate a spread from
Z95 = 1.959964  # a stated default is taken as known: the normal quantile
MEASURED, REPLICATES, DEFAULT = "measured", "replicates", "default"
SPREAD_HINT = "python scripts/bench_noise.py --spread-only measures it"


@dataclass(frozen=True)
class Spread:
    """One reading's run-to-run spread (coefficient of variation, on the log scale), where it
    comes from, and its degrees of freedom (None: a stated default, taken as known)."""

    cv: float
    source: str  # MEASURED | REPLICATES | DEFAULT
    df: int | None = None
    runs: int | None = None  # MEASURED: fresh processes

    def threshold(self, n_a: int = 1, n_b: int = 1) -> float:
        """The log-scale difference two configurations read n_a and n_b times must exceed."""
        quantile = Z95 if self.df is None else t_quantile(0.975, self.df)
        return quantile * self.cv * math.sqrt(1.0 / n_a + 1.0 / n_b)

    def text(self) -> str:
        """What "within noise" meant, and where its spread came from."""
        factor = math.exp(self.threshold())
        within = f"{100 * (factor - 1):.0f}%" if factor < 2 else f"a factor of {factor:.3g}"
        source = {
            MEASURED: "measured for this machine and workload by scripts/bench_noise.py, "
            f"{self.runs} fresh processes",
            REPLICATES: f"from this study's replicates, {self.df} degrees of freedom",
            DEFAULT: f"a default: not measured for this machine and workload; {SPREAD_HINT}",
        }[self.source]
        return (
            f"run-to-run spread {100 * self.cv:.1f}% per reading: two single readings within "
            f"{within} are noise ({source})"
        )


@dataclass(frozen=True)
class Config:
    """One configuration: its trials (the first first) and their pooled values."""

    trials: tuple[Any, ...]
    values: tuple[float, ...]

    @property
    def first(self) -> Any:
        return self.trials[0]

    @property
    def number(self) -> int:
        return int(self.first.number)


@dataclass(frozen=True)
class Group:
    """Configurations within noise of its first (the leader): one choice."""

    configs: tuple[Config, ...]

    @property
    def leader(self) -> Config:
        return self.configs[0]

    @property
    def numbers(self) -> tuple[int, ...]:
        return tuple(t.number for c in self.configs for t in c.trials)

    @property
    def size(self) -> int:
        return len(self.numbers)


@dataclass(frozen=True)
class NoiseView:
    """What the summary, the report and the page say about noise in a study: its feasible
    configurations (in the order first measured), each objective noisy (a gpuopt metric) or exact."""

    spread: Spread
    configs: tuple[Config, ...]
    noisy: tuple[bool, ...]
    directions: tuple[str, ...]

    def _apart(self, a: Config, b: Config, k: int) -> bool:
        """Measurably apart on objective k (an exact objective: apart when it differs)."""
        x, y = a.values[k], b.values[k]
        if not self.noisy[k]:
            return x != y
        limit = self.spread.threshold(len(a.trials), len(b.trials))
        if x > 0 and y > 0:  # log ratio; a relative difference at or below 0
            return abs(math.log(x / y)) > limit
        scale = max(abs(x), abs(y))
        return scale != 0 and abs(x - y) / scale > limit

    def _groups(self, configs: Sequence[Config], objectives: Sequence[int]) -> tuple[Group, ...]:
        """`configs` best first on the first objective, in groups: each its leader and the rest
        within noise of it on every one of `objectives`."""
        sign = -1 if self.directions[0] == "maximize" else 1
        groups, left = [], sorted(configs, key=lambda c: sign * c.values[0])
        while left:
            leader = left.pop(0)
            members = [c for c in left if not any(self._apart(leader, c, k) for k in objectives)]
            left = [c for c in left if c not in members]
            groups.append(Group((leader, *members)))
        return tuple(groups)

    @cached_property
    def ranked(self) -> tuple[Group, ...]:
        """Every configuration by the first objective, best first, in groups within noise."""
        return self._groups(self.configs, [0])

    @cached_property
    def front(self) -> tuple[Group, ...]:
        """Several objectives: the configurations no other one measurably dominates (better beyond
        noise on an objective, worse beyond noise on none), grouped when within noise of each
        other on every objective; () for one objective."""
        objectives = range(len(self.directions))
        if len(objectives) < 2:
            return ()

        def better(a: Config, b: Config, k: int) -> bool:
            higher = a.values[k] > b.values[k]
            return self._apart(a, b, k) and higher == (self.directions[k] == "maximize")

        def dominates(a: Config, b: Config) -> bool:
            return any(better(a, b, k) for k in objectives) and not any(
                better(b, a, k) for k in objectives
            )

        configs = self.configs
        front = [c for c in configs if not any(dominates(o, c) for o in configs if o is not c)]
        # never empty (a cycle cannot form; kept safe regardless)
        return self._groups(front or configs, objectives)

    def config_of(self, number: int) -> Config | None:
        return next((c for c in self.configs if number in (t.number for t in c.trials)), None)

    def apart(self, a: int, b: int, k: int = 0) -> bool | None:
        """Whether trials `a` and `b`'s configurations are measurably apart on objective k; None
        when either is not among the feasible trials."""
        first, second = self.config_of(a), self.config_of(b)
        if first is None or second is None:
            return None
        return self._apart(first, second, k)

    def group_of(self, number: int) -> int | None:
        """The 1-based place of the ranked group trial `number` is in (None: not ranked)."""
        for place, group in enumerate(self.ranked, 1):
            if number in group.numbers:
                return place
        return None


def config_key(params: dict[str, Any]) -> tuple:
    """Trials with the same params are one configuration."""
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def pooled(values: Sequence[float]) -> float:
    """Several readings of one value: their geometric mean (a ratio scale), else their mean."""
    if all(v > 0 for v in values):
        return math.exp(sum(math.log(v) for v in values) / len(values))
    return sum(values) / len(values)


def configurations(trials: Sequence[Any]) -> list[Config]:
    """Feasible trials (with values) grouped by configuration, in the order first measured."""
    by_key: dict[tuple, list[Any]] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        if trial.values:
            by_key.setdefault(config_key(dict(trial.params)), []).append(trial)
    return [
        Config(tuple(group), tuple(pooled(v) for v in zip(*(t.values for t in group), strict=True)))
        for group in by_key.values()
    ]


def spread_of(trials: Sequence[Any]) -> Spread:
    """Measured (a trial's `run_spread`, the baseline's first), else the replicates', else
    DEFAULT_SPREAD (replicates only with MIN_REPLICATE_DF degrees of freedom)."""
    ordered = sorted(trials, key=lambda t: not t.user_attrs.get(ATTR_BASELINE))
    for trial in ordered:
        cv, runs = trial.user_attrs.get("run_spread"), trial.user_attrs.get("run_spread_runs")
        if isinstance(cv, (int, float)) and cv > 0 and isinstance(runs, int) and runs >= 2:
            return Spread(float(cv), MEASURED, runs - 1, runs)
    squares, df = 0.0, 0
    for config in configurations(trials):
        logs = [math.log(t.values[0]) for t in config.trials if t.values[0] > 0]
        if len(logs) > 1:
            squares += statistics.variance(logs) * (len(logs) - 1)
            df += len(logs) - 1
    if df >= MIN_REPLICATE_DF and squares > 0:
        return Spread(math.sqrt(squares / df), REPLICATES, df)
    return Spread(DEFAULT_SPREAD, DEFAULT)


def noise_view(trials: Sequence[Any], names: Sequence[str], directions: Sequence[str]) -> NoiseView:
    """The study's noise groups over its feasible trials (`trials`)."""
    noisy = tuple(name in goals() for name in names)
    return NoiseView(spread_of(trials), tuple(configurations(trials)), noisy, tuple(directions))


# ---- in words (the sweep summary and the report) -------------------------------------------------


def within_text(group: Group, names: Sequence[str]) -> str:
    """`7 trials within noise of each other: one choice (#3, #2+#4, ...; throughput 4,397-5,645
    samples/s)`: a configuration read several times as its trials joined by +."""
    configs = len(group.configs)
    if configs == 1:
        head = f"1 configuration read {group.size} times"
    else:
        of = f" ({configs} configurations)" if configs != group.size else ""
        head = f"{group.size} trials{of} within noise of each other"
    limit = 12  # configurations named
    shown = ["+".join(f"#{t.number}" for t in c.trials) for c in group.configs[:limit]]
    members = ", ".join(shown) + (f", ... {configs - limit} more" if configs > limit else "")
    ranges = []
    for k, name in enumerate(names):
        values = [t.values[k] for c in group.configs for t in c.trials]
        low, high = fmt_metric(name, min(values), unit=False), fmt_metric(name, max(values))
        ranges.append(f"{name} {low}-{high}")
    return f"{head}: one choice ({members}; {', '.join(ranges)})"


def runner_up_text(view: NoiseView, number: int) -> str | None:
    """That the best (trial `number`) is within noise of the runner-up (the other configurations'
    first trials, best first, within noise of its own on the first objective); None when not."""
    own = view.config_of(number)
    ordered = [c for group in view.ranked for c in group.configs]
    within = [c.number for c in ordered if own and c is not own and not view._apart(own, c, 0)]
    if not within:
        return None
    others = ", ".join(f"#{n}" for n in within[:8]) + (", ..." if len(within) > 8 else "")
    return (
        f"best #{number} is within noise of {others} in the sweep's readings: not "
        "distinguishable from the runner-up"
    )


def best_noise_lines(
    view: NoiseView, best: int, baseline: int | None, confirmation: Any | None
) -> list[str]:
    """What noise says of the best pick (trial `best`) where no confirmation (a
    gpuopt.study.records.Confirmation) said it: within noise of the baseline, or of its runner-up;
    the summary's and the report's words."""
    confirmed = confirmation is not None and bool(confirmation.comparisons)
    lines = []
    unconfirmed = not confirmed and baseline is not None and best != baseline
    if unconfirmed and view.apart(best, baseline) is False:  # type: ignore[arg-type]
        lines.append("within noise of the baseline: nothing here is measurably faster")
    if not confirmed or confirmation.top_two is None:
        runner_up = runner_up_text(view, best)
        if runner_up:
            lines.append(runner_up)
    if lines and not view.front:  # several objectives: the front's lines say it
        lines.append(f"within noise: {view.spread.text()}")
    return lines


def front_lines(
    view: NoiseView, names: Sequence[str], shown: Callable[[Any], str], limit: int = 10
) -> list[str]:
    """The Pareto front, noise grouped: each choice's leader (`shown(trial)`) and what is within
    noise of it; one group of several trials is no trade-off at all."""
    groups = list(view.front)
    if not groups:
        return []
    one = len(groups) == 1 and groups[0].size > 1  # no trade-off at all
    if one:
        lines = [f"Pareto front: no trade-off beyond noise: {within_text(groups[0], names)}"]
    else:
        trials = sum(g.size for g in groups)
        cut = f", {limit} of {len(groups)} shown" if len(groups) > limit else ""
        lines = [f"Pareto front ({len(groups)} choice(s) beyond noise, {trials} trial(s){cut}):"]
    for group in groups[:limit]:
        lines.append(f"  #{group.leader.number}: {shown(group.leader.first)}")
        if group.size > 1 and not one:
            lines.append(f"      {within_text(group, names)}")
    lines.append(f"  within noise: {view.spread.text()}")
    return lines
