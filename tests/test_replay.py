"""The grid replay (scripts/replay.py): lookup, trials-to-reach, determinism, and the default sampler's
search on the shipped, measured grid (benchmarks/grid_cpu.json)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import optuna
import pytest

# The replay is a benchmark helper (scripts/), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from replay import (
    DEFAULT_GRID_PATH,
    Contender,
    Grid,
    GridPoint,
    ReplayRun,
    SearchSetup,
    compare_samplers,
    gpuopt_contenders,
    replay,
)

from gpuopt.sweeper.options import SweeperOptions

BATCH = [16, 32, 64, 128]
WORKERS = [0, 1, 2]


def _encoded_grid(space_batch: str = "choice(16,32,64,128)") -> Grid:
    """A grid whose value encodes its configuration, so a wrong lookup shows as a wrong value."""
    points = [
        GridPoint(
            {"loader.batch_size": b, "loader.num_workers": w, "precision": p},
            "ok",
            b * 10 + w + (0.5 if p == "bf16" else 0),
        )
        for b, w, p in itertools.product(BATCH, WORKERS, ["fp32", "bf16"])
    ]
    space = {
        "loader.batch_size": space_batch,
        "loader.num_workers": "choice(0,1,2)",
        "precision": "choice(fp32,bf16)",
    }
    return Grid(space=space, points=points)


def test_replay_answers_each_asked_config_with_its_measured_value() -> None:
    grid = _encoded_grid()
    run = replay(grid, optuna.samplers.RandomSampler(seed=3), 30)
    assert len(run.params) == len(run.values) == 30
    for params, value in zip(run.params, run.values, strict=False):
        expected = params["loader.batch_size"] * 10 + params["loader.num_workers"]
        expected += 0.5 if params["precision"] == "bf16" else 0
        assert value == expected


def test_interval_spaces_snap_to_the_nearest_grid_value_in_log_scale() -> None:
    grid = _encoded_grid(space_batch="tag(log, int(interval(16, 128)))")
    assert (
        grid.snap({"loader.batch_size": 45, "loader.num_workers": 1, "precision": "fp32"})[
            "loader.batch_size"
        ]
        == 32
    )
    assert (
        grid.snap({"loader.batch_size": 46, "loader.num_workers": 1, "precision": "fp32"})[
            "loader.batch_size"
        ]
        == 64
    )
    run = replay(grid, optuna.samplers.RandomSampler(seed=0), 20)
    assert {p["loader.batch_size"] for p in run.params} - set(
        BATCH
    )  # the sampler asked off-grid values
    assert all(v is not None and v // 10 in BATCH for v in run.values)  # and got grid values back


def test_trials_to_reach_counts_up_to_the_first_trial_at_the_target() -> None:
    run = ReplayRun("x", 0, params=[{}] * 5, values=[1.0, None, 5.0, 3.0, 9.0])
    assert run.best_so_far() == [1.0, 1.0, 5.0, 5.0, 9.0]
    assert run.trials_to_reach(5.0) == 3
    assert run.trials_to_reach(9.0) == 5
    assert run.trials_to_reach(9.5) is None
    low = ReplayRun("x", 0, params=[{}] * 3, values=[4.0, 2.0, 3.0], direction="minimize")
    assert low.trials_to_reach(2.0) == 2


def test_failed_grid_points_are_told_as_failures_not_values() -> None:
    grid = _encoded_grid()
    best = grid.best()
    points = [GridPoint(p.params, "oom", None) if p is best else p for p in grid.points]
    broken = Grid(space=grid.space, points=points)
    assert broken.best().value < best.value
    run = replay(broken, optuna.samplers.RandomSampler(seed=0), 60)
    assert None in run.values  # the oom point was asked and is not a value
    assert max(v for v in run.values if v is not None) <= broken.best().value


def test_multi_objective_setup_tells_the_extra_metric_and_runs_the_baseline_first() -> None:
    grid = _encoded_grid()
    points = [
        GridPoint(p.params, p.status, p.value, {"utilization": 100 - p.value}) for p in grid.points
    ]
    grid = Grid(space=grid.space, points=points)
    baseline = {"loader.batch_size": 32, "loader.num_workers": 0, "precision": "fp32"}
    setup = SearchSetup(
        ("throughput", "utilization"),
        ("maximize", "maximize"),
        enqueue=(baseline,),
        space={**grid.space, "precision": "choice(fp32)"},
    )
    run = replay(grid, optuna.samplers.TPESampler(seed=0), 15, setup=setup)
    assert run.params[0] == baseline
    assert {p["precision"] for p in run.params} == {"fp32"}  # the trimmed space is what is asked


class _SeenTold(optuna.samplers.RandomSampler):
    """A random sampler that notes, per trial, how many trials had been told when it was asked."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed=seed)
        self.told_when_asked: dict[int, int] = {}

    def sample_independent(self, study, trial, name, distribution):  # type: ignore[no-untyped-def]
        finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        done = study.get_trials(deepcopy=False, states=finished)
        self.told_when_asked.setdefault(trial.number, len(done))
        self.study = study
        return super().sample_independent(study, trial, name, distribution)


def test_a_race_tells_its_baseline_alone_then_asks_the_screen_at_once_and_answers_at_its_end() -> (
    None
):
    """As gpuopt/sweeper/race/runner.py asks: trial 0 (the baseline) told first, the other
    trials asked before any of them is told; the answer is the screen's best, known at its end."""
    grid = _encoded_grid()
    baseline = {"loader.batch_size": 128, "loader.num_workers": 2, "precision": "bf16"}  # the best
    sampler = _SeenTold(seed=0)
    setup = SearchSetup(enqueue=(baseline,), race=5)
    run = replay(grid, sampler, 13, setup=setup)
    assert len(run.values) == 13 and run.params[0] == baseline
    assert run.round_ends == [1, 6, 11, 13]  # the baseline, then screens of 5 (the last short)
    told = sampler.told_when_asked
    assert [told[n] for n in range(1, 13)] == [1] * 5 + [6] * 5 + [11] * 2  # each round blind
    assert run.trials_to_reach(grid.best().value) == 1  # the baseline's own value: trial 1
    # each screen tells its best 2 (the runner's finalists) with values, the rest PRUNED
    trials = sampler.study.get_trials()
    first_screen = [t for t in trials[1:6] if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(first_screen) == 2
    pruned = [t.intermediate_values[0] for t in trials[1:6] if t not in first_screen]
    assert max(pruned) <= min(t.value for t in first_screen)
    run.values[0] = None  # were the best found by the screen, it would be known at its end
    assert run.trials_to_reach(max(v for v in run.values[1:6] if v is not None)) == 6
    assert (
        replay(grid, _SeenTold(seed=0), 50, setup=SearchSetup(enqueue=(baseline,))).trials_to_reach(
            grid.best().value
        )
        == 1
    )  # without the race: at once


def test_a_race_tells_no_candidate_the_screen_reads_below_its_floor() -> None:
    """The runner's floor: a screen whose candidates all read below `race_floor` of the baseline
    tells none of them with values (no whole trial); with a floor under them, its best 2."""
    grid = _encoded_grid()
    best = grid.best()
    sampler = _SeenTold(seed=0)
    floor = 1.0 + 1e-9  # nothing beats the grid's best, which is the baseline here
    run = replay(
        grid, sampler, 6, setup=SearchSetup(enqueue=(best.params,), race=5, race_floor=floor)
    )
    states = [t.state for t in sampler.study.get_trials()[1:6]]
    assert run.params[0] == best.params and states == [optuna.trial.TrialState.PRUNED] * 5
    lowest = min(v for v in run.values[1:6] if v is not None) / best.value
    low = SearchSetup(enqueue=(best.params,), race=5, race_floor=lowest * 0.99)
    sampler = _SeenTold(seed=0)
    replay(grid, sampler, 6, setup=low)
    told = [
        t for t in sampler.study.get_trials()[1:6] if t.state == optuna.trial.TrialState.COMPLETE
    ]
    assert len(told) == 2


def test_gpuopt_default_races_unless_the_race_is_off(grid: Grid) -> None:
    raced = gpuopt_contenders(grid, sampler_only=False)[0].setup
    unraced = gpuopt_contenders(grid, ["hydra.sweeper.race.enabled=false"], sampler_only=False)
    assert raced.race > 1 and unraced[0].setup.race == 0
    assert raced.race_floor == SweeperOptions().race.floor > 0  # the runner's own floor


# -- the shipped, measured grid ------------------------------------------------------------------


@pytest.fixture(scope="module")
def grid() -> Grid:
    return Grid.load(DEFAULT_GRID_PATH)


@pytest.fixture(scope="module")
def default(grid: Grid) -> Contender:
    """gpuopt's default search (sampler, objectives, baseline, trimming) from the composed config."""
    return gpuopt_contenders(grid)[0]


def test_shipped_grid_is_a_complete_measured_grid(grid: Grid) -> None:
    assert len(grid.points) >= 100
    assert grid.is_complete()
    assert sum(p.ok for p in grid.points) >= 0.9 * len(grid.points)
    assert "command" in grid.meta and "measure_grid.py" in grid.meta["command"]
    # every configuration the sweeper's parser can produce from the space is in the grid
    dists = grid.distributions()
    for combo in itertools.product(*(d.choices for d in dists.values())):  # type: ignore[attr-defined]
        grid.lookup(dict(zip(dists, combo, strict=False)))


def test_replay_is_deterministic_for_a_seed(grid: Grid, default: Contender) -> None:
    first = replay(grid, default.factory(7), 25, setup=default.setup)
    again = replay(grid, default.factory(7), 25, setup=default.setup)
    other = replay(grid, default.factory(8), 25, setup=default.setup)
    assert first.params == again.params and first.values == again.values
    assert first.params != other.params


def test_default_search_finds_95_percent_of_the_optimum_not_later_than_random(
    grid: Grid, default: Contender
) -> None:
    """Seeded, so it cannot flake; it fails if the sampler, its wiring or the lookup breaks (a
    flipped direction, values told to the wrong trial, a lost baseline or trimming)."""
    n = len(grid.points)
    seeds = range(5)
    ours, random = compare_samplers(
        grid,
        [default, Contender("random", lambda s: optuna.samplers.RandomSampler(seed=s))],
        seeds,
        budget=n,
        fractions=(0.95,),
    )
    assert ours.reached(0.95) == len(seeds)  # every seed gets there within one grid's worth
    ours_median = ours.median(0.95)
    random_median = random.median(0.95) or float(n + 1)
    assert ours_median is not None and ours_median <= random_median
    assert ours_median <= 0.5 * n
