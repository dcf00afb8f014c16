"""Noise said as noise (issue 36): trials the measurements cannot tell apart are one group in the
summary, the report and the page, an unconfirmed best is no answer, a sampler's repeat is never a
blind new trial, and a single run says what its interval covers.

Every reading here is a stored value (no timing is raced against another): the A/A study is the
issue's own, eight trials of one configuration (throughput 4,397-5,645, utilization 54.6-64.0%).
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial
from rich.console import Console

from gpuopt.core.machine_cache import RunSpread, read_spread, save_spread
from gpuopt.core.metrics import Metrics
from gpuopt.core.result import Status, TrialResult
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_OVERRIDES,
    ATTR_REPLACES,
    ATTR_REPLICATE_OF,
    ATTR_VOID,
)
from gpuopt.study.noise import DEFAULT, MEASURED, REPLICATES, noise_view, spread_of
from gpuopt.study.rules import pick_best, pick_same_training
from gpuopt.sweeper import outputs, resume
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.sweeper.space import SearchSpace
from gpuopt.sweeper.trials import TrialRunner
from tests.helpers.sweep_outputs import sweep_identity

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

SEEDS = CategoricalDistribution([0, 1, 2, 3, 4, 5, 6])
# The A/A sweep: the baseline's configuration with another seed each; #3 and #6 are one
# configuration (the sampler asked seed=2 twice) and read 25% apart.
AA = [  # (seed, throughput, utilization): 7 of 8 on Optuna's front, #0 dominated by #2
    (0, 4744.7, 60.1),
    (1, 5100.0, 60.5),
    (4, 4900.0, 61.5),
    (2, 4397.0, 64.0),
    (3, 5645.0, 54.6),
    (5, 5200.0, 58.0),
    (2, 5478.0, 57.0),
    (6, 4600.0, 63.1),
]
NAMES = ["throughput_amortized", "utilization"]


def _study(tmp_path: Path, directions: list[str], name: str = "s") -> optuna.Study:
    """A real SQLite study (the sweeper's default storage)."""
    return optuna.create_study(
        study_name=name, storage=f"sqlite:///{tmp_path / 'noise.db'}", directions=directions
    )


def _add(study: optuna.Study, seed: int, values: list[float], **attrs: Any) -> None:
    attrs.setdefault(ATTR_OVERRIDES, [f"seed={seed}"])
    study.add_trial(
        create_trial(
            state=TrialState.COMPLETE,
            values=values,
            params={"seed": seed},
            distributions={"seed": SEEDS},
            user_attrs=attrs,
        )
    )


def _aa_study(tmp_path: Path, **baseline_attrs: Any) -> optuna.Study:
    study = _study(tmp_path, ["maximize", "maximize"])
    for number, (seed, throughput, util) in enumerate(AA):
        attrs = {ATTR_BASELINE: True, **baseline_attrs} if number == 0 else {}
        _add(study, seed, [throughput, util], **attrs)
    return study


# ---- item 2: fronts and rankings that say what is noise ------------------------------------------


def test_an_aa_sweeps_summary_names_the_noise_group_instead_of_a_front(tmp_path):
    """Optuna's front holds 7 of the 8 identical configurations as "trade-offs"; the summary says
    they are one choice, which spread it judged them by, and lists no front of trade-offs."""
    study = _aa_study(tmp_path)
    assert len(study.best_trials) == 7  # noise makes a front of trade-offs for Optuna
    text = outputs.write_outputs(study, sweep_identity(tmp_path, *NAMES), None, 1.0)
    assert "Pareto front: no trade-off beyond noise: 8 trials (7 configurations) within noise of " \
           "each other: one choice" in text  # fmt: skip
    assert "throughput_amortized 4,397-5,645 samples/s" in text and "#3+#6" in text
    assert "Pareto front (" not in text  # no list of trade-offs
    assert "a default: not measured for this machine and workload" in text  # which spread


def test_a_measured_spread_splits_what_the_default_one_groups(tmp_path):
    """With scripts/bench_noise.py's spread on the trials (1% here: a quiet machine), the same
    readings are apart: the front has choices again, and the summary says the spread measured."""
    study = _aa_study(tmp_path, run_spread=0.01, run_spread_runs=8)
    text = outputs.write_outputs(study, sweep_identity(tmp_path, *NAMES), None, 1.0)
    assert re.search(r"Pareto front \(\d+ choice\(s\) beyond noise, \d+ trial\(s\)\):", text)
    assert "measured for this machine and workload by scripts/bench_noise.py, 8 fresh" in text
    assert spread_of(study.trials).source == MEASURED


def test_the_spread_comes_from_the_studys_replicates_when_not_measured(tmp_path):
    study = _study(tmp_path, ["maximize"])
    for seed, value in ((1, 100.0), (1, 110.0), (2, 200.0), (2, 180.0), (3, 300.0)):
        _add(study, seed, [value])
    spread = spread_of(study.trials)
    assert spread.source == REPLICATES and spread.df == 2 and 0.05 < spread.cv < 0.1
    one_pair = _study(tmp_path, ["maximize"], "one")
    for seed, value in ((1, 100.0), (1, 140.0)):
        _add(one_pair, seed, [value])
    assert spread_of(one_pair.trials).source == DEFAULT  # one difference: too few to estimate


def test_an_unconfirmed_best_is_no_answer_and_says_its_runner_up_is_within_noise(tmp_path):
    """No confirmation round: the best's single reading is never "speedup over baseline"; it is
    within noise of the baseline and of its runner-up, and the summary says both."""
    study = _study(tmp_path, ["maximize"])
    for seed, value in ((0, 1000.0), (1, 1095.0), (2, 1080.0), (3, 500.0)):
        _add(study, seed, [value], **({ATTR_BASELINE: True} if seed == 0 else {}))
    text = outputs.write_outputs(study, sweep_identity(tmp_path), None, 1.0)
    assert "speedup over baseline" not in text
    assert "not confirmed (no confirmation round): #1 read 1.095x the baseline's throughput" in text
    assert "within noise of the baseline: nothing here is measurably faster" in text
    assert "best #1 is within noise of #2, #0 in the sweep's readings: not distinguishable" in text


def test_a_repeat_of_the_baseline_is_the_baseline_never_a_best_of_its_own(tmp_path):
    """The issue's sweep named a trial identical to the baseline the best at 1.095x and wrote it
    as best_same_training.yaml: its reading is pooled with the baseline's, one configuration."""
    study = _study(tmp_path, ["maximize"])
    _add(study, 0, [1000.0], **{ATTR_BASELINE: True})
    _add(study, 0, [1095.0], **{ATTR_REPLICATE_OF: 0})
    _add(study, 1, [900.0])
    trials = study.trials
    baseline = trials[0]
    assert pick_best(trials, [], ["maximize"], None) is not None
    assert pick_best(trials, [], ["maximize"], None).number == 0
    assert pick_same_training(trials, baseline, ["maximize"], None).number == 0
    text = outputs.write_outputs(study, sweep_identity(tmp_path), None, 1.0)
    assert "best      #0" in text and "read 1.095x" not in text
    assert not (tmp_path / "experiment" / "best_same_training.yaml").exists()
    assert "replicates: 1 (#1 of #0)" in text


def test_the_report_and_the_page_group_what_the_sweep_cannot_tell_apart(tmp_path):
    from gpuopt.report.build import build_report
    from gpuopt.report.page import front_table, trials_table
    from gpuopt.report.text import render

    study = _aa_study(tmp_path)
    study.set_user_attr("objectives", NAMES)
    report = build_report(study)
    assert report.noise is not None and [g.size for g in report.noise.front] == [8]
    out = io.StringIO()
    render(report, Console(file=out, width=240))
    text = out.getvalue()
    assert "Pareto front: no trade-off beyond noise (8 trials, one choice)" in text
    assert "┃ ≈ ┃" in text  # the trials table's noise-group column
    page = trials_table(report) + front_table(report)  # the terminal's tables, as HTML
    assert "<th>≈</th>" in page and 'data-value="1">1</td>' in page
    assert "Pareto front: no trade-off beyond noise (8 trials, one choice)" in page
    assert "8 trials (7 configurations) within noise of each other" in page


def test_noise_groups_rank_the_first_objective_and_keep_real_trade_offs_apart():
    """Two configurations 1.5x apart on one objective and within noise on the other are no
    trade-off: the worse one is measurably dominated; a real trade-off stays two choices."""
    from types import SimpleNamespace

    def t(number: int, values: list[float]) -> SimpleNamespace:
        return SimpleNamespace(number=number, values=values, params={"k": number}, user_attrs={})

    trials = [t(0, [1000.0, 61.0]), t(1, [3000.0, 60.0]), t(2, [2950.0, 59.0]), t(3, [900, 90.0])]
    view = noise_view(trials, ["throughput", "utilization"], ["maximize", "maximize"])
    # #0's 61% is #1's 60% (noise), its throughput a third: dominated; #3's 90% is a real trade-off
    assert [g.numbers for g in view.front] == [(1, 2), (3,)]
    assert [g.numbers for g in view.ranked] == [(1, 2), (0, 3)]


# ---- item 3: no blind repeats ------------------------------------------------------------------------


class RepeatingSampler(optuna.samplers.BaseSampler):
    """Asks the same configuration every time (the first choice of each key): every trial after
    the first is a repeat, as TPE's startup trials and a raced screen sometimes are."""

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, name, distribution):
        return distribution.choices[0]


SPACE = {
    "loader.batch_size": CategoricalDistribution([32, 64]),
    "loader.num_workers": CategoricalDistribution([0, 1]),
}


def _runner(n_trials: int, **options: Any) -> TrialRunner:
    """The sweeper's trial loop of an app gpuopt measures (its objective is a gpuopt metric)."""
    return TrialRunner(
        launcher=None,
        options=SweeperOptions.build(objectives=["throughput"], **options),
        config=OmegaConf.create({}),
        n_trials=n_trials,
        storage_text="sqlite",
        recovery=resume.Recovery(60),
    )


def _repeating_study(tmp_path: Path) -> optuna.Study:
    """The baseline (batch 32, no worker: the sampler's own pick) measured, and a sampler that
    asks it again every time."""
    study = optuna.create_study(
        storage=f"sqlite:///{tmp_path / 'r.db'}", sampler=RepeatingSampler(), direction="maximize"
    )
    baseline = {"loader.batch_size": 32, "loader.num_workers": 0}
    study.add_trial(
        create_trial(
            state=TrialState.COMPLETE,
            value=100.0,
            params=baseline,
            distributions=SPACE,
            user_attrs={ATTR_BASELINE: True},
        )
    )
    return study


def _ask_and_tell(runner: TrialRunner, study: optuna.Study, space: SearchSpace) -> Any:
    (trial,), _ = runner.ask(study, 1, study.get_trials(deepcopy=False), space)
    study.tell(trial, 100.0 + trial.number)
    return study.trials[trial.number]


def test_a_samplers_repeat_is_replaced_until_the_space_is_exhausted_then_a_replicate(tmp_path):
    """The sampler asks the baseline's configuration every time: each trial runs an unmeasured
    one instead (recorded), no trial is voided; once none is left, the repeat is a replicate."""
    study = _repeating_study(tmp_path)
    space = SearchSpace(dict(SPACE), {}, [])
    runner = _runner(n_trials=6)
    ran = [_ask_and_tell(runner, study, space) for _ in range(3)]
    assert [t.number for t in ran] == [1, 2, 3]  # no trial voided, none renumbered
    configs = [tuple(t.params.values()) for t in ran]
    assert len(set(configs)) == 3 and (32, 0) not in configs  # each one unmeasured till then
    for t in ran:  # what the sampler asked, and whose configuration that was
        assert t.user_attrs[ATTR_REPLACES] == {
            "asked": "loader.batch_size=32 loader.num_workers=0",
            "repeat_of": 0,
        }
    replicate = _ask_and_tell(runner, study, space)  # nothing unmeasured is left
    assert replicate.user_attrs[ATTR_REPLICATE_OF] == 0
    assert replicate.params == study.trials[0].params and ATTR_REPLACES not in replicate.user_attrs
    assert not any(t.user_attrs.get(ATTR_VOID) for t in study.trials)
    text = outputs.write_outputs(study, sweep_identity(tmp_path), None, 1.0)
    assert "repeats: the sampler asked 3 measured configuration(s) again; unmeasured ones" in text
    assert f"replicates: 1 (#{replicate.number} of #0)" in text


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_without_a_repeat_the_wrapped_sampler_draws_what_the_sampler_alone_draws(sampler):
    """The wrapper only replaces repeats: it draws each key as Optuna would (the relative sample,
    then the others independently, in the space's order), so a seeded sampler's trials are the
    same with it and without it while nothing repeats (a space too large to repeat in 8 trials)."""
    from optuna.distributions import IntDistribution

    from gpuopt.sweeper.repeats import install

    space = {"a": IntDistribution(0, 10_000), "b": CategoricalDistribution(list(range(50)))}

    def drawn(wrapped: bool) -> list[dict[str, Any]]:
        inner = (
            optuna.samplers.RandomSampler(seed=3)
            if sampler == "random"
            else optuna.samplers.TPESampler(seed=3, multivariate=True, n_startup_trials=3)
        )
        study = optuna.create_study(sampler=inner)
        if wrapped:
            install(study, space)
        for _ in range(8):
            trial = study.ask()
            a, b = (
                trial.suggest_int("a", 0, 10_000),
                trial.suggest_categorical("b", list(range(50))),
            )
            study.tell(trial, float(a + b))
        return [t.params for t in study.trials]

    assert drawn(wrapped=True) == drawn(wrapped=False)


def test_a_repeat_enqueued_on_purpose_runs_as_a_replicate(tmp_path):
    study = _repeating_study(tmp_path)
    study.enqueue_trial({"loader.batch_size": 32, "loader.num_workers": 0})
    trial = _ask_and_tell(_runner(4), study, SearchSpace(dict(SPACE), {}, []))
    assert trial.number == 1 and trial.user_attrs[ATTR_REPLICATE_OF] == 0
    assert not any(t.user_attrs.get(ATTR_VOID) for t in study.trials)


def test_an_enqueued_key_stays_and_only_the_samplers_keys_avoid_a_repeat(tmp_path):
    """A seed that holds the batch and leaves the rest to the sampler (the same-training seed):
    its batch is on purpose, the sampler's draw of the rest must not make it a repeat."""
    study = _repeating_study(tmp_path)
    study.enqueue_trial({"loader.batch_size": 32})
    trial = _ask_and_tell(_runner(4), study, SearchSpace(dict(SPACE), {}, []))
    assert trial.params == {"loader.batch_size": 32, "loader.num_workers": 1}
    assert trial.user_attrs[ATTR_REPLACES]["repeat_of"] == 0
    assert ATTR_REPLICATE_OF not in trial.user_attrs


def test_the_races_screen_asks_no_repeat(tmp_path):
    """The race asks a whole screen at once (9 by default; the trial loop with the race's round
    as its batch) and the sampler may repeat itself within it: each asked configuration is one
    the study does not hold."""
    import time

    from gpuopt.sweeper.progress import Progress

    study = _repeating_study(tmp_path)
    space = SearchSpace(dict(SPACE), {}, [])
    runner = _runner(4, race={"screen": 3})
    screened: list[Any] = []

    def round_(study, trials, space, progress):  # the screen: each configured, told
        for trial in trials:
            runner.configure(trial, space)
            screened.append(trial)
            study.tell(trial, 1.0)

    progress = Progress(4, ["throughput"], ["maximize"], time.monotonic())
    runner.run(study, 3, space, progress, round_, runner.options.race.screen)
    configs = [tuple(t.params.values()) for t in screened]
    assert len(screened) == 3 and len(set(configs)) == 3 and (32, 0) not in configs


# ---- item 5: intervals that say what they cover ------------------------------------------------------


def _result() -> TrialResult:
    metrics = Metrics(throughput=4744.7, throughput_ci=0.049, timed_steps=38, timed_seconds=1.0)
    env = {"device": "cpu", "cpu_model": "Test CPU", "usable_cpus": 2, "torch": "2.13.0"}
    config = {"model": {"name": "mlp"}, "data": {"size": 256}, "loader": {"batch_size": 32}}
    return TrialResult(status=Status.OK, metrics=metrics, env=env, config=config)


def _table(result: TrialResult) -> str:
    from gpuopt.run import print_result

    out = io.StringIO()
    print_result(result, console=Console(file=out, width=200))
    return out.getvalue()


def test_a_single_run_says_its_interval_is_one_windows_and_the_spread_is_not_known(
    tmp_path, monkeypatch
):
    from gpuopt.run import with_run_spread

    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(tmp_path))
    result = _result()
    with_run_spread(result)
    text = _table(result)
    assert "± 4.9% (95% CI over this window's steps)" in text
    assert re.search(r"run to run\s+│\s+not known", text) and "bench_noise.py --spread-only" in text
    saved = result.to_dict()["metrics"]
    assert saved["run_spread"] is None
    assert saved["intervals"].startswith("throughput_ci: 95% over the 38 steps of this one window")
    assert "run to run: not known for this machine and workload" in saved["intervals"]


def test_a_single_run_gives_the_spread_bench_noise_stored_for_its_machine_and_workload(
    tmp_path, monkeypatch
):
    import bench_noise

    from gpuopt.run import with_run_spread

    monkeypatch.setenv("GPUOPT_CACHE_DIR", str(tmp_path))
    measured = _result()
    runs = [{"throughput": v, "env": measured.env, "config": measured.config}
            for v in (4397.0, 5478.0, 4744.7, 5100.0)]  # fmt: skip
    bench_noise.save_spread(runs)  # what scripts/bench_noise.py stores after its rounds
    spread = read_spread(measured.env, measured.config)
    assert spread is not None and spread.runs == 4 and 0.08 < spread.cv < 0.1
    result = _result()
    result.config["loader"] = {"batch_size": 512}  # another configuration of the workload
    with_run_spread(result)
    assert (
        result.metrics.run_spread == pytest.approx(spread.cv)
        and result.metrics.run_spread_runs == 4
    )
    assert re.search(r"run to run\s+│\s+± \d\.\d%\s+│ CV between 4 fresh processes", _table(result))
    assert (
        f"run to run: {100 * spread.cv:.1f}% (coefficient of variation" in result.metrics.intervals
    )
    other = _result()
    other.config["model"] = {"name": "cnn"}  # another workload: not measured
    assert read_spread(other.env, other.config) is None
    save_spread(other.env, other.config, RunSpread(0.02, 5), tmp_path / "elsewhere.json")
    assert read_spread(other.env, other.config, tmp_path / "elsewhere.json") == RunSpread(0.02, 5)


@pytest.mark.slow
def test_a_sweep_over_an_exhausted_space_measures_replicates_never_blind_repeats(tmp_path):
    """A real multirun (fresh processes, the stand-in engine): 4 trials of a 2-configuration
    space. Whatever the sampler asks, the baseline's configuration is not run blind again; once
    both are measured, the rest are replicates, marked and counted in the summary."""
    from tests.test_sweep_e2e import TINY, fake, load, ok

    proc = ok(
        fake(
            tmp_path,
            *TINY,
            "hydra.sweeper.study_name=s",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.confirm.rounds=0",
            "hydra.sweeper.seeding=false",
            "loader.batch_size=choice(32,64)",
        )
    )
    trials = load(tmp_path, "s").get_trials()
    ran = [t for t in trials if t.user_attrs.get("status") == "ok"]
    assert len(ran) == 4 and ran[0].user_attrs[ATTR_BASELINE]
    firsts = {}
    for t in ran:
        batch = t.params["loader.batch_size"]
        if batch in firsts:  # a configuration measured before: a replicate, marked
            assert t.user_attrs[ATTR_REPLICATE_OF] == firsts[batch]
        else:
            firsts[batch] = t.number
            assert ATTR_REPLICATE_OF not in t.user_attrs
    assert set(firsts) == {32, 64}  # the unmeasured one ran before any replicate
    assert ran[1].params["loader.batch_size"] == 64
    assert "replicates: 2 (" in proc.stdout
