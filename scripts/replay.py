"""Replay a measured grid as a lookup-table objective, to compare search strategies without hardware.

Measuring every configuration of a reference search space once (scripts/measure_grid.py) turns the
question "how many trials does a sampler need to find a fast configuration?" into a deterministic,
seconds-long computation: each sampler asks for configurations exactly as the sweeper would
(`study.ask` with the distributions Hydra's Optuna sweeper builds from the same `choice(...)`
override strings), and the grid answers with the throughput that was measured for it.
scripts/bench_search.py reports the result; tests/test_replay.py checks the search logic with it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import TrialState

GRID_FORMAT = "gpuopt-grid/1"
# The shipped reference grid (measured on the 2-core CPU dev machine; see docs/benchmarks.md).
DEFAULT_GRID_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "grid_cpu.json"

SamplerFactory = Callable[[int], BaseSampler]


def _key(value: Any) -> str:
    """Grid values compare by their override spelling, so 64 == "64" and True == "true"."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


@dataclass(frozen=True)
class GridPoint:
    """One measured configuration: its override values and what the engine reported."""

    params: dict[str, Any]
    status: str
    value: float | None  # the objective (e.g. throughput) when status == "ok"
    extra: dict[str, Any] = field(default_factory=dict)  # other metrics, wall time, ...

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.value is not None and math.isfinite(self.value)


@dataclass
class Grid:
    """A full factorial grid over `space` (override key -> Hydra sweep string) with one measurement
    per configuration, plus how and where it was measured."""

    space: dict[str, str]
    points: list[GridPoint]
    objective: str = "throughput"
    direction: str = "maximize"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.direction not in ("maximize", "minimize"):
            raise ValueError(f"grid direction={self.direction!r}; allowed: maximize | minimize")
        self._index = {self._point_key(p.params): p for p in self.points}
        if len(self._index) != len(self.points):
            raise ValueError("grid has duplicate configurations")

    # -- the search space ------------------------------------------------------------------------
    def distributions(self) -> dict[str, BaseDistribution]:
        """The Optuna distributions the sweeper would build from `space` (same parser)."""
        from gpuopt.core._compat import create_params_from_overrides

        dists, fixed, _ = create_params_from_overrides([f"{k}={v}" for k, v in self.space.items()])
        if fixed:
            raise ValueError(f"grid space entries are not sweeps: {sorted(fixed)}")
        return dists

    def axes(self) -> dict[str, list[Any]]:
        """The values each key takes in the grid, in first-seen order."""
        axes: dict[str, list[Any]] = {k: [] for k in self.space}
        for point in self.points:
            for k in self.space:
                if _key(point.params[k]) not in map(_key, axes[k]):
                    axes[k].append(point.params[k])
        return axes

    def is_complete(self) -> bool:
        return len(self.points) == math.prod(len(v) for v in self.axes().values())

    # -- lookups ---------------------------------------------------------------------------------
    def _point_key(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        missing = [k for k in self.space if k not in params]
        if missing:
            raise KeyError(f"configuration lacks grid keys {missing}")
        return tuple(_key(params[k]) for k in self.space)

    def snap(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Map sampled values onto grid values (nearest, in log scale for positive numbers), for
        spaces written as intervals; categorical values pass through unchanged."""
        snapped: dict[str, Any] = {}
        for k, values in self.axes().items():
            v = params[k]
            if any(_key(v) == _key(a) for a in values) or not isinstance(v, (int, float)):
                snapped[k] = v
                continue
            numeric = [a for a in values if isinstance(a, (int, float)) and not isinstance(a, bool)]
            positive = v > 0 and all(a > 0 for a in numeric)
            snapped[k] = min(
                numeric, key=lambda a: abs(math.log(a / v)) if positive else abs(a - v)
            )
        return snapped

    def lookup(self, params: Mapping[str, Any]) -> GridPoint:
        return self._index[self._point_key(self.snap(params))]

    def best(self) -> GridPoint:
        feasible = [p for p in self.points if p.ok]
        if not feasible:
            raise ValueError("grid has no successful measurement")
        pick = max if self.direction == "maximize" else min
        return pick(feasible, key=lambda p: p.value)  # type: ignore[arg-type,return-value]

    def best_where(self, keep: Callable[[Mapping[str, Any]], bool]) -> GridPoint:
        """The best feasible point whose params `keep` accepts (e.g. the same training)."""
        feasible = [p for p in self.points if p.ok and keep(p.params)]
        if not feasible:
            raise ValueError("no feasible grid point is accepted")
        pick = max if self.direction == "maximize" else min
        return pick(feasible, key=lambda p: p.value)  # type: ignore[arg-type,return-value]

    def target(self, fraction: float) -> float:
        """The value that counts as reaching `fraction` of the grid optimum."""
        best = self.best().value
        assert best is not None
        return best * fraction if self.direction == "maximize" else best / fraction

    def rank_of(self, value: float) -> int:
        """How many feasible grid points are at least as good as `value` (1 = the optimum)."""
        better = (lambda p: p >= value) if self.direction == "maximize" else (lambda p: p <= value)
        return sum(1 for p in self.points if p.ok and better(p.value))

    # -- file format -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": GRID_FORMAT,
            "objective": self.objective,
            "direction": self.direction,
            "space": self.space,
            "meta": self.meta,
            "points": [
                {"params": p.params, "status": p.status, "value": p.value, **p.extra}
                for p in self.points
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Grid:
        if data.get("format") != GRID_FORMAT:
            raise ValueError(f"grid format={data.get('format')!r}; allowed: {GRID_FORMAT}")
        points = [
            GridPoint(
                params=dict(p["params"]),
                status=str(p["status"]),
                value=p.get("value"),
                extra={k: v for k, v in p.items() if k not in ("params", "status", "value")},
            )
            for p in data["points"]
        ]
        return cls(
            space=dict(data["space"]),
            points=points,
            objective=str(data.get("objective", "throughput")),
            direction=str(data.get("direction", "maximize")),
            meta=dict(data.get("meta") or {}),
        )

    @classmethod
    def load(cls, path: str | Path = DEFAULT_GRID_PATH) -> Grid:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass
class ReplayRun:
    """One search replayed on a grid: what was asked, in order, and what the grid answered."""

    sampler: str
    seed: int
    params: list[dict[str, Any]]
    values: list[float | None]  # None: an infeasible/failed grid point (told to Optuna as FAIL)
    direction: str = "maximize"
    # A race: the trial counts at which its rounds end (a round's best is known at its end only).
    round_ends: list[int] = field(default_factory=list)
    # Per trial: told with its values (a whole trial; a race prunes the rest), and whether it keeps
    # the baseline's global batch (the setup's rule; the first trial, the baseline, always does).
    whole: list[bool] = field(default_factory=list)
    same: list[bool] = field(default_factory=list)

    def best_so_far(self) -> list[float | None]:
        best: float | None = None
        out: list[float | None] = []
        for v in self.values:
            if v is not None and (
                best is None or (v > best if self.direction == "maximize" else v < best)
            ):
                best = v
            out.append(best)
        return out

    def trials_to_reach(self, target: float) -> int | None:
        """1-based count of trials until the best value reaches `target`; None if never. In a
        race a screen's best is known once its round ends: the end of the round that reached it."""
        for n, best in enumerate(self.best_so_far(), start=1):
            if best is not None and (
                best >= target if self.direction == "maximize" else best <= target
            ):
                return next((end for end in self.round_ends if end >= n), n)
        return None

    def same_training_best(self, upto: int) -> float | None:
        """The best value of the first `upto` trials that answer (a) can be: whole trials (told
        with values, so measured and confirmable) that keep the baseline's global batch."""
        values = [
            v
            for v, whole, same in zip(self.values[:upto], self.whole, self.same, strict=False)
            if v is not None and whole and same
        ]
        if not values:
            return None
        return max(values) if self.direction == "maximize" else min(values)

    def distinct_configs(self, upto: int | None = None) -> int:
        return len({json.dumps(p, sort_keys=True, default=str) for p in self.params[:upto]})


@dataclass(frozen=True)
class SearchSetup:
    """How a search asks and what it is told, besides its sampler.

    `objectives[0]` is the one trials-to-reach is counted on (the grid's objective); further ones
    (e.g. utilization) are read from the grid points' other metrics and told as a multi-objective
    study. `enqueue` are first trials with fixed params (a baseline; keys it lacks are sampled).
    `space` replaces the grid's space (a subset of its choices, e.g. after device-aware trimming).
    `race`: the sweep races (gpuopt/sweeper/race/) in screens of `race` trials: the first trial
    (the baseline) told alone, then rounds of `race` trials asked at once before any is told; the
    screen is taken to rank by the grid's values (its short windows' noise aside).
    """

    objectives: tuple[str, ...] = ()  # empty: the grid's objective only
    directions: tuple[str, ...] = ()  # empty: the grid's direction for each objective
    n_jobs: int = 1
    enqueue: tuple[dict[str, Any], ...] = ()
    space: dict[str, str] | None = None
    race: int = 0
    race_finalists: int = 2  # a screen's trials told with values; the rest are told PRUNED
    race_floor: float = 0.0  # ...of those at this ratio to the baseline (the first trial) or above
    # Which configurations keep the baseline's global batch (gpuopt.sweeper.global_batch.BatchRule):
    # answer (a) is read from them; None: no rule.
    rule: Any = None
    race_same_training: bool = True  # the race keeps the best of them as one more finalist

    def batch(self, asked: int, budget: int) -> int:
        """How many trials the next ask takes, `asked` already asked."""
        if self.race:
            return min(1 if asked == 0 else self.race, budget - asked)
        return min(self.n_jobs, budget - asked)


def _values(grid: Grid, point: GridPoint, objectives: Sequence[str]) -> list[float] | None:
    values = []
    for name in objectives:
        value = point.value if name == grid.objective else point.extra.get(name)
        if value is None or not math.isfinite(value):
            return None
        values.append(float(value))
    return values


def _told(
    answers: Sequence[list[float] | None],
    setup: SearchSetup,
    direction: str,
    baseline: float | None,
    same: Sequence[bool] = (),
) -> set[int]:
    """Which of a screen's trials the race tells with values: its best `race_finalists` by the
    first objective's ratio to the `baseline` value (> 1: faster), of those at `race_floor` or
    above, and the best that keeps the training (`same`) when none of those does, chosen as the
    runner chooses them (`policy.finalists`); the others it tells PRUNED."""
    from gpuopt.sweeper.race import policy

    keeps = {str(i) for i, kept in enumerate(same) if kept and setup.race_same_training}

    sign = 1.0 if direction == "maximize" else -1.0
    if not baseline or baseline <= 0:  # no baseline reading: ranked by value, no floor
        scores = {str(i): sign * a[0] if a is not None else None for i, a in enumerate(answers)}
        return {int(label) for label in policy.finalists(scores, setup.race_finalists)}

    def ratio(values: list[float] | None) -> float | None:
        if values is None or values[0] <= 0:
            return None
        return values[0] / baseline if direction == "maximize" else baseline / values[0]

    scores = {str(i): ratio(a) for i, a in enumerate(answers)}
    chosen = policy.finalists(scores, setup.race_finalists, setup.race_floor, keeps)
    return {int(label) for label in chosen}


def replay(
    grid: Grid,
    sampler: BaseSampler,
    n_trials: int,
    *,
    setup: SearchSetup = SearchSetup(),
    name: str = "",
    seed: int = 0,
    stop_at: float | None = None,
) -> ReplayRun:
    """Run a search on the grid's lookup table with Optuna's ask/tell, `setup.n_jobs` trials asked
    per batch before any is told (as a sweeper with that many parallel jobs does). A point that
    failed when measured (or lacks an objective) is told as FAIL. `stop_at` ends the search once
    the first objective reaches it (the rest of the budget cannot change trials-to-reach)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    objectives = list(setup.objectives) or [grid.objective]
    if objectives[0] != grid.objective:
        raise ValueError(
            f"the first objective must be the grid's ({grid.objective}), got {objectives[0]}"
        )
    directions = list(setup.directions) or [grid.direction] * len(objectives)
    if len(objectives) == 1:
        study = optuna.create_study(sampler=sampler, direction=directions[0])
    else:
        study = optuna.create_study(sampler=sampler, directions=directions)
    for params in setup.enqueue:
        study.enqueue_trial(dict(params))
    distributions = (
        Grid(space=setup.space, points=[]).distributions() if setup.space else grid.distributions()
    )
    run = ReplayRun(sampler=name, seed=seed, params=[], values=[], direction=grid.direction)
    while len(run.values) < n_trials:
        batch = [study.ask(distributions) for _ in range(setup.batch(len(run.values), n_trials))]
        answers, same = [], []
        for trial in batch:
            point = grid.lookup(trial.params)
            answers.append(_values(grid, point, objectives) if point.ok else None)
            run.params.append(dict(trial.params))
            run.values.append(answers[-1][0] if answers[-1] is not None else None)
            same.append(not run.same or (setup.rule is not None and setup.rule.holds(trial.params)))
            run.same.append(same[-1])
        raced = setup.race and len(batch) > 1
        told = _told(answers, setup, grid.direction, run.values[0], same) if raced else None
        run.whole += [told is None or i in told for i in range(len(batch))]
        for i, (trial, values) in enumerate(zip(batch, answers, strict=True)):
            if values is None:
                study.tell(trial, state=TrialState.FAIL)
            elif told is not None and i not in told:  # raced out: pruned, its reading reported
                if len(objectives) == 1:
                    trial.report(values[0], step=0)
                study.tell(trial, state=TrialState.PRUNED)
            else:
                study.tell(trial, values[0] if len(values) == 1 else values)
        if setup.race:
            run.round_ends.append(len(run.values))
        if stop_at is not None and run.trials_to_reach(stop_at) is not None:
            break
    return run


@dataclass(frozen=True)
class Contender:
    """A search strategy to compare: a seeded sampler factory and how it is set up."""

    name: str
    factory: SamplerFactory
    setup: SearchSetup = SearchSetup()


@dataclass
class SamplerSummary:
    """Trials-to-reach for one sampler over several seeds; None entries never reached (censored)."""

    sampler: str
    budget: int
    reach: dict[float, list[int | None]]  # fraction of optimum -> per-seed trials to reach it

    def median(self, fraction: float) -> float | None:
        """Median trials to reach, counting a censored seed as worse than any budget; None when
        more than half the seeds never reached it."""
        counts = [math.inf if c is None else float(c) for c in self.reach[fraction]]
        med = statistics.median(counts)
        return None if math.isinf(med) else med

    def reached(self, fraction: float, within: int | None = None) -> int:
        """Seeds that reached `fraction` of the optimum (within `within` trials, if given)."""
        return sum(c is not None and (within is None or c <= within) for c in self.reach[fraction])


def compare_samplers(
    grid: Grid,
    contenders: Sequence[Contender],
    seeds: Iterable[int],
    *,
    budget: int | None = None,
    fractions: Sequence[float] = (0.95, 0.99),
    progress: Callable[[str, int], None] | None = None,
) -> list[SamplerSummary]:
    """Replay each contender with each seed for up to `budget` trials (default: the grid's size)
    and count the trials each needs to reach each fraction of the grid optimum."""
    budget = budget or len(grid.points)
    seeds = list(seeds)
    hardest = grid.target(max(fractions))
    summaries = []
    for contender in contenders:
        reach: dict[float, list[int | None]] = {f: [] for f in fractions}
        for seed in seeds:
            run = replay(
                grid,
                contender.factory(seed),
                budget,
                setup=contender.setup,
                name=contender.name,
                seed=seed,
                stop_at=hardest,
            )
            for f in fractions:
                reach[f].append(run.trials_to_reach(grid.target(f)))
            if progress:
                progress(contender.name, seed)
        summaries.append(SamplerSummary(sampler=contender.name, budget=budget, reach=reach))
    return summaries


@dataclass
class SameTrainingReach:
    """Answer (a) on a grid: per seed, the best same-training whole trial of a `budget`-trial
    search against the grid's best same-training point (the baseline's global batch)."""

    sampler: str
    budget: int
    optimum: GridPoint  # the grid's best configuration that keeps the baseline's global batch
    found: list[float | None]  # per seed

    def reached(self, fraction: float = 0.95) -> int:
        """Seeds whose (a) reached `fraction` of the grid's best same-training value."""
        assert self.optimum.value is not None
        return sum(v is not None and v >= fraction * self.optimum.value for v in self.found)


def same_training_reach(
    grid: Grid, contender: Contender, seeds: Iterable[int], budget: int = 10
) -> SameTrainingReach:
    """Replay `contender` (its setup must have a rule: gpuopt's full default) with each seed for
    `budget` trials and read what answer (a) could be: the best whole trial that keeps the
    baseline's global batch (the baseline itself among them). Maximized objectives only."""
    rule = contender.setup.rule
    if rule is None or grid.direction != "maximize":
        raise ValueError("same-training reach needs a rule and a maximized objective")
    found = []
    for seed in seeds:
        run = replay(grid, contender.factory(seed), budget, setup=contender.setup, seed=seed)
        found.append(run.same_training_best(budget))
    optimum = grid.best_where(rule.holds)
    return SameTrainingReach(contender.name, budget, optimum, found)


def optuna_contenders() -> list[Contender]:
    """Optuna's samplers with their library defaults, seeded, single-objective on the grid's
    objective: what a user of plain Optuna (or hydra-optuna-sweeper) gets."""
    return [
        Contender("random", lambda seed: optuna.samplers.RandomSampler(seed=seed)),
        Contender("tpe", lambda seed: optuna.samplers.TPESampler(seed=seed)),
        Contender("gp", lambda seed: optuna.samplers.GPSampler(seed=seed)),
        Contender("nsgaii", lambda seed: optuna.samplers.NSGAIISampler(seed=seed)),
    ]


@dataclass(frozen=True)
class SweeperDefaults:
    """What `python -m gpuopt.run -m` does by default, read from the composed config (not copied):
    the sampler config, the objectives, parallel jobs, the baseline and device-aware trimming."""

    sampler: Any  # the hydra.sweeper.sampler node (a `_target_` config)
    objectives: tuple[str, ...]
    directions: tuple[str, ...]
    n_jobs: int
    n_trials: int  # the preset's trial budget
    baseline: bool
    device_aware: bool
    config: Any  # the composed config (DictConfig, with its hydra node), for the baseline's values
    seeding: bool = False  # expert seeds after the baseline (gpuopt/sweeper/seeding.py)
    race: bool = False  # the trials raced in one process (gpuopt/sweeper/race/)
    race_screen: int = 0  # ...in screens of this many candidates
    race_finalists: int = 2  # ...each screen's best this many measured as whole trials
    race_floor: float = 0.0  # ...of those the screen reads at this ratio to the baseline or above

    def factory(self) -> SamplerFactory:
        from hydra.utils import instantiate

        from gpuopt.sweeper.plugin import SAMPLER_WHITELIST

        return lambda seed: instantiate(
            self.sampler, seed=seed, _execution_whitelist_=SAMPLER_WHITELIST
        )

    def setup(self, grid: Grid, *, full: bool = True) -> SearchSetup:
        """The sweeper's setup on the grid's space. `full=False`: the sampler alone (one objective,
        no baseline, no trimming), to compare samplers on equal terms."""
        if not full:
            return SearchSetup(n_jobs=self.n_jobs)
        space = dict(grid.space)
        if self.device_aware and grid.meta.get("poor_choices"):
            from gpuopt.core.knobs import canonical
            from gpuopt.sweeper.space import drop_poor_choices

            poor = grid.meta["poor_choices"]  # {key: {value: why}}, as the grid's machine judged
            space = drop_poor_choices(
                space, lambda key, value: poor.get(key, {}).get(canonical(value))
            ).params
        enqueue: tuple[dict[str, Any], ...] = ()
        if self.baseline:
            from gpuopt.sweeper.space import baseline_params

            fitting, _outside = baseline_params(
                self.config, Grid(space=space, points=[]).distributions()
            )
            # The baseline as it runs: a key it leaves unset runs torch's default (threads = the
            # cores), not a value the sampler would pick for it (seeding.as_run).
            enqueue = (as_run(grid, space, fitting),)
            if self.seeding:
                seeds = grid_seeds(grid, space, fitting, self.n_trials - 1)
                enqueue += tuple(s.params for s in seeds)
        objectives = self.objectives if self.objectives[0] == grid.objective else (grid.objective,)
        directions = self.directions if objectives == self.objectives else (grid.direction,)
        race = self.race_screen if self.race and self.baseline and self.n_jobs == 1 else 0
        return SearchSetup(
            objectives,
            directions,
            self.n_jobs,
            enqueue,
            space if space != grid.space else None,
            race=race,
            race_finalists=self.race_finalists,
            race_floor=self.race_floor,
            rule=grid_rule(grid, self.config) if self.baseline else None,
        )


def baseline_point(grid: Grid, baseline: Mapping[str, Any], cores: int) -> GridPoint | None:
    """The grid point the baseline trial measures: its params, and for keys it leaves as
    configured (e.g. device.num_threads=null) torch's default: threads = the cores."""
    matching = [
        p
        for p in grid.points
        if p.ok and all(_key(p.params.get(k)) == _key(v) for k, v in baseline.items())
    ]
    threads = [p for p in matching if p.params.get("device.num_threads") == cores]
    return (threads or matching or [None])[0]


def point_costs(point: GridPoint) -> tuple[float | None, float | None]:
    """(loader, compute) core-microseconds per sample: the point's measured loader_cost_us /
    compute_cost_us when the grid has them; else, for a point without workers (the loader runs in
    the step's process), derived from its window: the data wait's share of the step is the
    loader's, the rest the compute's on its threads."""
    measured = point.extra.get("loader_cost_us"), point.extra.get("compute_cost_us")
    if all(measured):
        return measured
    params, extra = point.params, point.extra
    wait, step = extra.get("data_wait"), extra.get("step_time_ms")
    if params.get("loader.num_workers") != 0 or wait is None or not step:
        return None, None
    batch = float(params["loader.batch_size"])
    threads = int(params.get("device.num_threads") or 1)
    loader_us = wait / 100 * step * 1e3
    return loader_us / batch, (step * 1e3 - loader_us) * threads / batch


def _facts(grid: Grid, point: GridPoint | None) -> Any:
    """seeding's facts of a grid's machine and its baseline point's costs."""
    from gpuopt.sweeper.seeding import SeedFacts

    cores = int((grid.meta.get("machine") or {}).get("cpus") or 1)
    loader, compute = point_costs(point) if point is not None else (None, None)
    poor = (grid.meta.get("poor_choices") or {}).get("precision") or {}
    return SeedFacts(
        device_type=str(grid.meta.get("device_type", "cpu")),
        cores=cores,
        loader_cost_us=loader,
        compute_cost_us=compute,
        ceiling_throughput=point.extra.get("ceiling_throughput") if point else None,
        limit_bound=point.extra.get("limit_bound") if point else None,
        native_low_precision=bool(grid.meta.get("bf16_native")) and "bf16" not in poor,
    )


def _choices(space: Mapping[str, str]) -> dict[str, list[Any]]:
    return {
        k: list(d.choices)
        for k, d in Grid(space=dict(space), points=[]).distributions().items()
        if hasattr(d, "choices")
    }


def as_run(grid: Grid, space: Mapping[str, str], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The baseline's params as its trial runs them (seeding.as_run: the threads it leaves unset
    are torch's default, one per core), so the replay measures the point the sweep does."""
    from gpuopt.sweeper.seeding import as_run as run_as

    return run_as(_facts(grid, None), _choices(space), baseline)


def grid_rule(grid: Grid, config: Any) -> Any:
    """gpuopt's own task's rule of the global batch (sweeper/global_batch.py) for a sweep of the
    grid's space from `config` (the composed config, the grid's fixed overrides in it)."""
    from gpuopt.sweeper.global_batch import for_sweep

    return for_sweep(None, True, config, {}, list(grid.space))


def grid_seeds(
    grid: Grid, space: Mapping[str, str], baseline: Mapping[str, Any], room: int | None = None
) -> list[Any]:
    """The expert seeds the sweeper would enqueue after this grid's baseline (seeding.py), from
    the baseline point's costs, the grid machine's cores and the device-aware poor choices;
    `room`: the trials left after the baseline (the same-training share is a share of them)."""
    from gpuopt.sweeper.global_batch import gpuopt_rule
    from gpuopt.sweeper.seeding import plan_seeds

    cores = int((grid.meta.get("machine") or {}).get("cpus") or 1)
    facts = _facts(grid, baseline_point(grid, baseline, cores))
    choices = _choices(space)
    held = {k: baseline.get(k) for k in gpuopt_rule({}).keys}
    return plan_seeds(facts, choices, baseline, gpuopt_rule(held), room)


def sweeper_defaults(overrides: Sequence[str] = ()) -> SweeperDefaults:
    """Compose gpuopt's config as `python -m gpuopt.run -m [overrides]` would and read its sweeper
    settings."""
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401  (registers the config schema)
    from gpuopt.sweeper.objectives import resolve_objectives

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    names, directions = resolve_objectives(sweeper.get("objectives"), sweeper.get("direction"))
    return SweeperDefaults(
        sampler=sweeper.sampler,
        objectives=tuple(names),
        directions=tuple(directions),
        n_jobs=int(sweeper.n_jobs),
        n_trials=int(sweeper.n_trials),
        baseline=bool(sweeper.get("baseline", False)),
        device_aware=bool(sweeper.get("device_aware", False)),
        config=cfg,
        seeding=bool(sweeper.get("seeding", False)),
        race=bool((sweeper.get("race") or {}).get("enabled", False)),
        race_screen=int((sweeper.get("race") or {}).get("screen", 0)),
        race_finalists=int((sweeper.get("race") or {}).get("finalists", 2)),
        race_floor=float((sweeper.get("race") or {}).get("floor", 0.0)),
    )


def gpuopt_contenders(
    grid: Grid,
    variant: Sequence[str] = (),
    sampler_only: bool = True,
    defaults: SweeperDefaults | None = None,
) -> list[Contender]:
    """gpuopt's default search on the grid, as configured for the grid's workload: the full setup
    (objectives, baseline, device-aware trimming) and, with `sampler_only`, its sampler alone.
    `variant`: sweeper overrides to try instead of the defaults, e.g.
    ["hydra.sweeper.sampler.multivariate=true"]; they are named in the contenders' names.
    `defaults`: already composed (`sweeper_defaults`), instead of composing here."""
    if defaults is None:
        defaults = sweeper_defaults([*grid.meta.get("fixed_overrides", ()), *variant])
    name = "gpuopt default" + (
        f" [{' '.join(o.removeprefix('hydra.sweeper.') for o in variant)}]" if variant else ""
    )
    contenders = [Contender(name, defaults.factory(), defaults.setup(grid))]
    if sampler_only:
        contenders.append(
            Contender(
                name.replace("default", "sampler only", 1),
                defaults.factory(),
                defaults.setup(grid, full=False),
            )
        )
    return contenders
