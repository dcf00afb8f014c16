"""Expert seeds after the baseline (gpuopt/sweeper/seeding.py, baseline.enqueue_seeds) and the
seeded search on the shipped, replayed grid."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from gpuopt.study.keys import STUDY_BATCH_RULE
from gpuopt.sweeper import baseline
from gpuopt.sweeper.seeding import SeedFacts, core_splits, expert_seeds, loader_share, snap
from gpuopt.sweeper.space import build_search_space

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from replay import Contender, Grid, compare_samplers, gpuopt_contenders, grid_seeds

CPU_SPACE = {
    "loader.batch_size": [16, 32, 64, 128, 256, 512],
    "loader.num_workers": [0, 1, 2],
    "device.num_threads": [1, 2],
    "precision": ["fp32"],
}
BASE = {"loader.batch_size": 32, "loader.num_workers": 0, "precision": "fp32"}


def cpu(loader: float, compute: float, cores: int = 2) -> SeedFacts:
    return SeedFacts("cpu", cores, loader_cost_us=loader, compute_cost_us=compute)


@pytest.mark.parametrize(
    ("facts", "share", "splits"),
    [
        (cpu(290, 646), 0.62, [(1, 1), (2, 1)]),  # this machine's mlp: a spare worker
        (cpu(100, 100, cores=8), 4.0, [(4, 4), (5, 4)]),  # equal costs: half the cores each
        (cpu(30, 970), 0.06, [(1, 1), (0, 2)]),  # compute-bound: inline, every core computing
        (cpu(269, 1219), 0.36, [(1, 1), (0, 2)]),  # the cnn grid's baseline: under half a core
        (cpu(900, 100), 1.8, [(2, 1), (3, 1)]),  # loader-bound: threads keep at least one core
        (cpu(None, 646), None, []),  # not measured: no split
        (SeedFacts("cuda", 16, 20.0, None, 100_000.0, "compute"), 2.0, [(2, None), (3, None)]),
        (SeedFacts("cuda", 16, 20.0, None, 10**7, "loader"), 15.0, [(15, None), (16, None)]),
    ],
)
def test_core_split_from_the_measured_costs(facts, share, splits) -> None:
    got = loader_share(facts)
    assert (got if got is None else round(got, 2)) == share
    assert core_splits(facts) == splits


@pytest.mark.parametrize(
    ("value", "choices", "down", "expected"),
    [
        (3, [0, 1, 2, 4, 8], False, 4),  # log-nearest: 3 is nearer 4 than 2 in ratio
        (5, [0, 1, 2, 4, 8], False, 4),
        (3, [1, 2, 4], True, 2),  # threads snap down: never oversubscribe
        (0, [1, 2], True, 1),  # nothing below: the smallest
        (0, [0, 1, 2], False, 0),
        ("bf16", ["fp32", "bf16"], False, "bf16"),
        ("bf16", ["fp32"], False, None),
    ],
)
def test_snap_to_the_space_choices(value, choices, down, expected) -> None:
    assert snap(value, choices, down=down) == expected


def test_cpu_seeds_are_the_balanced_split_at_the_two_largest_batches() -> None:
    seeds = expert_seeds(cpu(290, 646), CPU_SPACE, BASE)
    assert [s.params for s in seeds] == [
        {"loader.batch_size": 512, "loader.num_workers": 1, "precision": "fp32", "device.num_threads": 1},
        {"loader.batch_size": 512, "loader.num_workers": 2, "precision": "fp32", "device.num_threads": 1},
        {"loader.batch_size": 256, "loader.num_workers": 1, "precision": "fp32", "device.num_threads": 1},
        {"loader.batch_size": 256, "loader.num_workers": 2, "precision": "fp32", "device.num_threads": 1},
    ]  # fmt: skip
    assert "2 workers (the alternative split)" in seeds[1].why
    for seed in seeds:  # every value is one of the space's choices
        assert all(v in CPU_SPACE[k] for k, v in seed.params.items())


def test_accelerator_seeds_use_native_bf16_and_pinned_memory() -> None:
    space = {
        "loader.batch_size": [64, 128, 256],
        "loader.num_workers": [0, 1, 2, 4, 8],
        "loader.pin_memory": [False, True],
        "precision": ["fp32", "tf32", "bf16"],
    }
    # 100k samples/s x 20 us = 2 loading cores: 2 workers, and a spare (3, snapped to 4)
    facts = SeedFacts("cuda", 8, 20.0, None, 100_000.0, "compute", native_low_precision=True)
    seeds = expert_seeds(facts, space, {"loader.batch_size": 64, "precision": "fp32"})
    assert {s.params["precision"] for s in seeds} == {"bf16"}
    assert {s.params["loader.pin_memory"] for s in seeds} == {True}
    assert [s.params["loader.num_workers"] for s in seeds] == [2, 4, 2, 4]
    assert [s.params["loader.batch_size"] for s in seeds] == [256, 256, 128, 128]
    assert all("device.num_threads" not in s.params for s in seeds)
    # a spare that snaps onto the same choice is one split, not two seeds
    three = SeedFacts("cuda", 8, 30.0, None, 100_000.0, "compute")
    assert len(expert_seeds(three, space, {"loader.batch_size": 64})) == 2
    # no native bf16: fp32 stays
    emulated = SeedFacts("cuda", 8, 20.0, None, 100_000.0, "compute", native_low_precision=False)
    base = {"loader.batch_size": 64, "precision": "fp32"}
    assert {s.params["precision"] for s in expert_seeds(emulated, space, base)} == {"fp32"}


def test_no_costs_still_seeds_the_largest_batches_and_never_the_baseline() -> None:
    seeds = expert_seeds(cpu(None, None), CPU_SPACE, {**BASE, "loader.batch_size": 512})
    assert [s.params["loader.batch_size"] for s in seeds] == [256]  # 512 is the baseline itself
    assert expert_seeds(cpu(None, None), {"precision": ["fp32"]}, {"precision": "fp32"}) == []


# ---- the hook: enqueued once, after a feasible baseline, not on a grid -------------------------


def _study_and_space(grid: bool = False):
    preset = {k: "choice(" + ",".join(map(str, v)) + ")" for k, v in CPU_SPACE.items()}
    space = build_search_space(preset, [], None, grid=grid)
    study = optuna.create_study(directions=["maximize", "maximize"])
    study.set_user_attr(
        "hardware", {"env": {"device": "cpu", "cpus": 2}, "poor_choices": {"precision": {}}}
    )
    return study, space


def _outcome(feasible: bool = True):
    attrs = {"loader_cost_us": 290.0, "compute_cost_us": 646.0, "env": {"usable_cpus": 2}}
    return SimpleNamespace(feasible=feasible, user_attrs=attrs)


def test_enqueue_seeds_once_after_the_baseline() -> None:
    study, space = _study_and_space()
    trial = SimpleNamespace(params=dict(BASE))
    baseline.enqueue_seeds(study, trial, _outcome(), space)
    baseline.enqueue_seeds(study, trial, _outcome(), space)  # a second call (resume): no more
    waiting = study.get_trials(states=[optuna.trial.TrialState.WAITING])
    assert len(waiting) == 4
    assert waiting[1].params == {} and waiting[1].system_attrs["fixed_params"] == {
        "loader.batch_size": 512,
        "loader.num_workers": 2,
        "precision": "fp32",
        "device.num_threads": 1,
    }
    assert "seed" in waiting[0].user_attrs
    assert len(study.user_attrs["seeds"]) == 4
    asked = study.ask(dict(space.distributions))  # the sampler's next trial is the first seed
    assert asked.params["loader.batch_size"] == 512 and asked.params["loader.num_workers"] == 1


def test_seeds_only_fill_the_room_the_study_has_left() -> None:
    """A baseline re-run that finished late (its first worker died): the other workers already
    hold n_trials but one, so one seed is enqueued, not four left waiting in the study forever."""
    study, space = _study_and_space()
    dist = dict(space.distributions)
    for batch in (16, 32, 64):
        study.add_trial(
            optuna.trial.create_trial(
                params={**BASE, "device.num_threads": 2, "loader.batch_size": batch},
                distributions=dist,
                values=[1.0, 1.0],
            )
        )
    # in flight in another worker (no owner recorded: counted as running); its params fixed, not
    # sampled: a sampled point equal to the first seed would make enqueue_trial skip that seed
    study.enqueue_trial({**BASE, "device.num_threads": 2, "loader.batch_size": 128})
    assert study.ask(dist).params["loader.batch_size"] == 128
    trial = SimpleNamespace(params=dict(BASE))
    baseline.enqueue_seeds(study, trial, _outcome(), space, n_trials=5)
    waiting = study.get_trials(states=[optuna.trial.TrialState.WAITING])
    assert len(waiting) == 1 and "seed" in waiting[0].user_attrs
    assert len(study.user_attrs["seeds"]) == 1
    assert baseline.seed_room(study.get_trials(), 5) == 0


@pytest.mark.parametrize(("feasible", "grid"), [(False, False), (True, True)])
def test_no_seeds_after_a_failed_baseline_or_on_a_grid(feasible, grid) -> None:
    study, space = _study_and_space(grid=grid)
    baseline.enqueue_seeds(study, SimpleNamespace(params=dict(BASE)), _outcome(feasible), space)
    assert study.get_trials() == []


# ---- the seeded search on the shipped grid ------------------------------------------------------


def test_replayed_grid_seeds_come_from_the_baseline_points_costs() -> None:
    grid = Grid.load()
    space = {"loader.batch_size": "choice(16,32,64,128,256,512)",
             "loader.num_workers": "choice(0,1,2)", "device.num_threads": "choice(1,2)",
             "precision": "choice(fp32)"}  # fmt: skip
    seeds = grid_seeds(grid, space, BASE)
    assert [(s.params["loader.batch_size"], s.params["loader.num_workers"]) for s in seeds] == [
        (512, 1),
        (512, 2),
        (32, 1),  # the same training: the baseline's batch, both splits
        (32, 2),
        (256, 1),
        (256, 2),
    ]


@pytest.mark.parametrize("grid_file", ["grid_cpu.json", "grid_cpu_cnn.json"])
def test_seeded_default_search_lands_in_ten_trials_on_both_measured_grids(grid_file) -> None:
    """The issue's goal on both measured grids (the input-bound mlp one and the cnn one): 95% of
    the optimum within the default 10 trials in >= 9 of 10 seeds, 99% within 10% of the grid;
    and better than the same search unseeded."""
    grid = Grid.load(Path(__file__).resolve().parents[1] / "benchmarks" / grid_file)
    seeded = gpuopt_contenders(grid, sampler_only=False)[0]
    plain = gpuopt_contenders(grid, ["hydra.sweeper.seeding=false"], sampler_only=False)[0]
    ours, unseeded = compare_samplers(
        grid, [seeded, Contender(plain.name, plain.factory, plain.setup)], range(10), budget=30
    )
    assert ours.reached(0.95, within=10) >= 9
    assert ours.median(0.99) is not None and ours.median(0.99) <= 0.1 * len(grid.points)
    assert ours.reached(0.95, within=10) > unseeded.reached(0.95, within=10)


def test_a_seed_that_only_spells_out_the_baselines_default_threads_is_not_enqueued() -> None:
    """A small batch axis: the inline split at the baseline's own batch would be the baseline
    again (it ran PyTorch's default of one thread per core)."""
    space = {**CPU_SPACE, "loader.batch_size": [2, 4]}
    base = {"loader.batch_size": 4, "loader.num_workers": 0, "precision": "fp32"}
    seeds = expert_seeds(cpu(30, 970), space, base)
    got = [
        (
            s.params["loader.batch_size"],
            s.params["loader.num_workers"],
            s.params["device.num_threads"],
        )
        for s in seeds
    ]
    assert got == [(4, 1, 1), (2, 1, 1), (2, 0, 2)]  # not (4, 0, 2): that is the baseline


# ---- answer (a) looked for on purpose: the baseline's global batch (issue 34) ---------------------


def test_the_baselines_global_batch_is_seeded_with_its_core_splits_and_a_share_of_the_sampler():
    """The default cnn sweep of issue 34 asked nothing at batch 32 but the sampler's chance: now
    two seeds hold it (the core splits, native bf16) and one of the sampler's trials has only the
    batch fixed there, the sampler choosing the rest."""
    from gpuopt.sweeper.global_batch import gpuopt_rule
    from gpuopt.sweeper.seeding import plan_seeds

    space = {**CPU_SPACE, "precision": ["fp32", "bf16"]}
    facts = SeedFacts("cpu", 2, 290.0, 646.0, native_low_precision=True)
    rule = gpuopt_rule({"loader.batch_size": 32})
    seeds = plan_seeds(facts, space, BASE, rule, room=9)
    full = [s for s in seeds if not s.partial]
    assert [s.params["loader.batch_size"] for s in full] == [512, 512, 32, 32, 256, 256]
    held = [s.params for s in full if rule.holds(s.params)]
    assert held == [
        {"loader.batch_size": 32, "loader.num_workers": 1, "precision": "bf16", "device.num_threads": 1},
        {"loader.batch_size": 32, "loader.num_workers": 2, "precision": "bf16", "device.num_threads": 1},
    ]  # fmt: skip
    assert all(s.why.startswith("same training (global batch 32 held") for s in seeds[2:4])
    assert [(s.params, s.partial) for s in seeds[6:]] == [({"loader.batch_size": 32}, True)]
    assert len(plan_seeds(facts, space, BASE, rule, room=2)) == 2  # a full study keeps the first


def test_with_accumulation_larger_micro_batches_make_the_same_global_batch():
    """gpuopt's train.global_batch=128 at micro-batch 32 (4 steps): every seed makes 128, the
    fewest steps first; none sizes a micro-batch that does not divide it (it would not run)."""
    from gpuopt.sweeper.global_batch import gpuopt_rule
    from gpuopt.sweeper.seeding import plan_seeds

    rule = gpuopt_rule({"loader.batch_size": 32, "train.global_batch": 128})
    space = {**CPU_SPACE, "loader.batch_size": [32, 64, 128, 256, 512]}
    seeds = plan_seeds(cpu(290, 646), space, BASE, rule, room=9)
    assert all(rule.of(s.params) == 128 for s in seeds)
    assert seeds[0].params["loader.batch_size"] == 128


def test_an_apps_batch_keys_seed_fewer_accumulation_steps_at_its_global_batch():
    """A Lightning app at 32 x accumulate_grad_batches 4: 128 x 1 and 64 x 2 were never asked
    (issue 34); they are seeded now, and a sampler's trial is held at 32 x 4."""
    from gpuopt.sweeper.global_batch import BatchRule
    from gpuopt.sweeper.seeding import plan_seeds

    micro, steps = "data.batch_size", "trainer.accumulate_grad_batches"
    rule = BatchRule((micro, steps), baseline={micro: 32, steps: 4})
    space = {micro: [32, 64, 128, 256], steps: [1, 2, 4], "data.num_workers": [0, 1, 2]}
    base = {micro: 32, steps: 4, "data.num_workers": 0}
    seeds = plan_seeds(SeedFacts("cpu", 2), space, base, rule, room=7)
    shapes = [(s.params[micro], s.params[steps], s.partial) for s in seeds]
    assert shapes == [(256, 4, False), (128, 4, False), (128, 1, False), (64, 2, False),
                      (32, 4, True)]  # fmt: skip


def test_enqueued_after_the_baseline_by_the_studys_rule():
    """The sweep records its rule on the study; the seeding after the baseline reads it and the
    held share is a trial with only the batch fixed: the sampler fills in the rest."""
    from gpuopt.sweeper import global_batch

    study, space = _study_and_space()
    study.set_user_attr(
        STUDY_BATCH_RULE, global_batch.gpuopt_rule({"loader.batch_size": 32}).to_attr()
    )
    # n_trials=9 and no trial in the study yet: room for 9, as a 10-trial sweep after its baseline
    baseline.enqueue_seeds(study, SimpleNamespace(params=dict(BASE)), _outcome(), space, 9)
    waiting = study.get_trials(states=[optuna.trial.TrialState.WAITING])
    assert [w.system_attrs["fixed_params"].get("loader.batch_size") for w in waiting] == [
        512, 512, 32, 32, 256, 256, 32
    ]  # fmt: skip
    assert waiting[-1].system_attrs["fixed_params"] == {"loader.batch_size": 32}
    for _ in range(6):
        study.ask(dict(space.distributions))
    held = study.ask(dict(space.distributions))
    assert held.params["loader.batch_size"] == 32 and set(held.params) == set(space.distributions)


@pytest.mark.parametrize("grid_file", ["grid_cpu.json", "grid_cpu_cnn.json"])
def test_the_default_search_reaches_the_best_same_training_configuration_on_both_grids(grid_file):
    """Issue 34's goal for answer (a), as P3 is for the best overall: within the default 10
    trials, a whole trial at the baseline's global batch reaches 95% of the grid's best one in
    >= 9 of 10 seeds (the mlp grid's: batch 32 with 2 workers and 1 thread, 1.36x the baseline,
    which the search before issue 34 reached in 0 of 10)."""
    from replay import same_training_reach

    grid = Grid.load(Path(__file__).resolve().parents[1] / "benchmarks" / grid_file)
    ours = gpuopt_contenders(grid, sampler_only=False)[0]
    assert same_training_reach(grid, ours, range(10), budget=10).reached(0.95) >= 9
