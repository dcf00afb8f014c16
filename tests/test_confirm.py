"""The confirmation's estimator against ground truth: scripted noisy fresh-process runs with a known
true speedup, through the real rounds (run_rounds: order, two-stage stop, cap) and the real record
(Measured.record, compare's verdicts, as stored). Coverage of the 95% interval, bias, the stop, the "too noisy" verdict."""

from __future__ import annotations

import math
import random
import statistics
from types import SimpleNamespace

import pytest

from gpuopt.core.stats import mean_interval, speedup, stein_pairs, t_quantile
from gpuopt.study.answers import speedup_text
from gpuopt.study.keys import STUDY_CONFIRMATION
from gpuopt.study.records import (
    FRESH_PROCESSES,
    Comparison,
    Confirmation,
    ConfirmedConfig,
)
from gpuopt.sweeper.comparison import Measurement
from gpuopt.sweeper.confirm.rounds import FRESH_LEVEL, Measured, Rule, run_rounds
from gpuopt.sweeper.confirm.schedule import ConfirmPlan, lean_overrides, with_overrides
from gpuopt.sweeper.confirm.verdicts import compare
from gpuopt.sweeper.record import store_confirmation


class ScriptedMachine:
    """Fresh-process runs of configs with known true throughputs: each run reads
    true x drift(run index) x lognormal(sigma). The drift (other work on the machine) is shared by
    neighbouring runs; the pairing has to cancel it."""

    def __init__(self, truth: dict[str, float], sigma, rng: random.Random, drift=0.0):
        self.truth, self.sigma, self.rng, self.drift = truth, sigma, rng, drift
        self.runs: list[str] = []

    def executor(self, cfgs: list[ConfirmedConfig]):
        """The comparison's executor for these configs: each label runs its `arm=` override."""
        arm_of = {c.label: c.overrides[0].split("=", 1)[1] for c in cfgs}

        def measure(label: str, job: int, so_far) -> Measurement:
            name = arm_of[label]
            self.runs.append(name)
            level = math.exp(self.drift * math.sin(len(self.runs) / 3.0))  # slow load swings
            sigma = self.sigma[name] if isinstance(self.sigma, dict) else self.sigma
            value = self.truth[name] * level * math.exp(self.rng.gauss(0.0, sigma))
            return Measurement("ok", value)

        return measure


def configs(*arms: str) -> list[ConfirmedConfig]:
    labels = ["baseline", *(f"candidate{i}" for i in range(1, len(arms)))]
    return [
        ConfirmedConfig(label, i, {}, [f"arm={arm}"])
        for i, (label, arm) in enumerate(zip(labels, arms, strict=True))
    ]


class Study(SimpleNamespace):
    def set_user_attr(self, key, value):
        self.user_attrs[key] = value


def sweep(machine, arms, max_runs, rounds=4, target=0.10, direction="maximize", level=0.95):
    """One confirmation as the sweeper runs it; (its record as stored, the configs). What the
    typed record writes is what its readers see."""
    cfgs = configs(*arms)
    plan = ConfirmPlan(top_k=len(arms) - 1, rounds=rounds, max_runs=max_runs)
    rule = Rule(direction, target, level)
    done = run_rounds(cfgs, plan, "throughput", machine.executor(cfgs), rule, load=lambda: 0.5)
    written = Measured("throughput", cfgs, plan, done, FRESH_PROCESSES).record(rule, 9, "here")
    study = Study(user_attrs={})
    assert store_confirmation(study, written) == written
    return study.user_attrs[STUDY_CONFIRMATION], cfgs


@pytest.mark.parametrize(
    ("true_ratio", "sigma", "drift", "max_runs"),
    [
        (1.0, 0.07, 0.0, 10),  # the same config twice, the default sweep's cap
        (1.0, 0.10, 0.3, 40),  # strong load swings: the pairs cancel them
        (1.6, 0.05, 0.1, 20),  # batch 256 vs 32-like
        (0.8, 0.14, 0.0, 60),  # a slower candidate, the noisiest fresh processes seen here
    ],
)
def test_interval_covers_the_true_speedup_95_percent_and_is_unbiased(
    true_ratio, sigma, drift, max_runs
):
    """Many simulated confirmations: the 95% interval holds the true ratio in ~95% of them (Stein's
    two-stage interval keeps its coverage after the data-dependent number of rounds; the naive
    running t-interval falls to ~92%), and the mean log-ratio estimate is unbiased."""
    rng = random.Random(15)
    hits, errors, sweeps = 0, [], 600
    for _ in range(sweeps):
        machine = ScriptedMachine({"A": 1000.0, "B": 1000.0 * true_ratio}, sigma, rng, drift)
        record, _ = sweep(machine, ["A", "B"], max_runs)
        (entry,) = record["comparisons"]
        hits += entry["ci_low"] <= true_ratio <= entry["ci_high"]
        errors.append(math.log(entry["ratio"]) - math.log(true_ratio))
    coverage = hits / sweeps
    assert 0.92 <= coverage <= 0.98, coverage  # binomial sd at 600 sweeps: 0.9%
    assert abs(statistics.fmean(errors)) < 0.01  # bias of the log-ratio, vs sigma 5-14%


def test_the_fresh_process_level_keeps_a_b_claims_of_the_same_config_under_3_percent():
    """The same configuration twice in fresh processes at the default cap (10 runs: 5 pairs), each
    process with its own layout draw (heavier-tailed than normal: 1 in 10 reads 20% slower). At
    FRESH_LEVEL the interval excludes 1.0x (a false claim) in <= 3% of confirmations; at 95% it
    would in ~5%, the rate the goal rules out."""
    rng, sweeps = random.Random(40), 800

    class LayoutDraw(ScriptedMachine):
        def executor(self, cfgs):
            plain = super().executor(cfgs)

            def measure(label, job, so_far):
                slow = 0.8 if self.rng.random() < 0.1 else 1.0
                reading = plain(label, job, so_far)
                return Measurement("ok", reading.value * slow)

            return measure

    rates = {}
    for level in (0.95, FRESH_LEVEL):
        claims = 0
        for _ in range(sweeps):
            machine = LayoutDraw({"A": 1000.0}, 0.05, rng)
            record, _ = sweep(machine, ["A", "A"], max_runs=10, target=0.05, level=level)
            (entry,) = record["comparisons"]
            assert entry["level"] == level and entry["n_pairs"] <= 5
            claims += entry["distinguishable"]
        rates[level] = claims / sweeps
    assert rates[FRESH_LEVEL] <= 0.03 < rates[0.95], rates  # binomial sd at 800: <= 0.8%
    text = speedup_text(Comparison.from_attr(entry))
    assert "(98% CI)" in text or "[98% CI" in text


def test_quiet_machine_stops_after_the_first_stage_within_the_target():
    machine = ScriptedMachine({"A": 1000.0, "B": 1200.0}, 0.01, random.Random(1))
    record, _ = sweep(machine, ["A", "B"], max_runs=40)
    (entry,) = record["comparisons"]
    assert record["rounds"] == 4 and len(machine.runs) == 8  # the cap allowed 40
    assert machine.runs == ["A", "B", "B", "A", "A", "B", "B", "A"]  # adjacent, alternating
    assert entry["verdict"] == "faster" and entry["halfwidth"] <= 0.10
    assert entry["ratio"] == pytest.approx(1.2, rel=0.03)
    assert Confirmation.from_attr(record).winner == 1


def test_noisier_pairs_get_more_rounds_until_the_interval_is_narrow_enough():
    machine = ScriptedMachine({"A": 1000.0, "B": 1000.0}, 0.08, random.Random(3))
    record, cfgs = sweep(machine, ["A", "B"], max_runs=200)
    (entry,) = record["comparisons"]
    assert record["rounds"] > 4 and record["rounds"] % 2 == 0  # whole A B / B A cycles
    assert entry["halfwidth"] <= 0.10 and entry["verdict"] == "same"
    assert entry["n_pairs"] == record["rounds"] == len(cfgs[1].confirm_values)
    assert Confirmation.from_attr(record).winner == 0  # no difference: keep the baseline


def test_a_candidate_with_its_pairs_leaves_the_rounds():
    """Two candidates as fast as each other: the quiet one stops after the first stage, the
    baseline goes on with the noisy one (a round of A and B2 only)."""
    sigma = {"A": 0.003, "B1": 0.003, "B2": 0.12}
    machine = ScriptedMachine({"A": 100.0, "B1": 150.0, "B2": 150.0}, sigma, random.Random(5))
    record, cfgs = sweep(machine, ["A", "B1", "B2"], max_runs=60)
    assert len(cfgs[1].confirm_values) == 4 < len(cfgs[2].confirm_values)
    assert machine.runs[:6] == ["A", "B1", "B2", "B2", "B1", "A"]
    assert "B1" not in machine.runs[12:] and machine.runs[12:14] in (["A", "B2"], ["B2", "A"])
    assert record["top_two"]["labels"] == ["candidate1", "candidate2"]


def test_a_candidate_the_first_stage_shows_slower_than_another_gets_no_more_rounds():
    """B2 is noisy (it would want many Stein rounds) but clearly slower than B1 in the first
    stage's paired B2/B1 ratios: it cannot be the answer, so only B1 and the baseline could go on
    (B1 is quiet: the round ends after the first stage). The answer is B1's."""
    sigma = {"A": 0.003, "B1": 0.003, "B2": 0.12}
    machine = ScriptedMachine({"A": 100.0, "B1": 200.0, "B2": 110.0}, sigma, random.Random(5))
    record, cfgs = sweep(machine, ["A", "B1", "B2"], max_runs=60)
    assert len(cfgs[1].confirm_values) == len(cfgs[2].confirm_values) == 4
    assert len(machine.runs) == 12 and record["rounds"] == 4
    assert Confirmation.from_attr(record).winner == cfgs[1].trial_number


def test_a_slower_same_training_candidate_keeps_its_rounds():
    """The same-training answer is confirmed too: a same-training candidate slower than a
    batch-changing one is not dropped (no same-training candidate beats it)."""
    sigma = {"A": 0.003, "B1": 0.003, "B2": 0.12}
    machine = ScriptedMachine({"A": 100.0, "B1": 200.0, "B2": 110.0}, sigma, random.Random(5))
    cfgs = configs("A", "B1", "B2")
    cfgs[2].same_training = True
    plan = ConfirmPlan(top_k=2, rounds=4, max_runs=60)
    rule = Rule("maximize", 0.10)
    run_rounds(cfgs, plan, "throughput", machine.executor(cfgs), rule, load=lambda: 0.5)
    assert len(cfgs[1].confirm_values) == 4 < len(cfgs[2].confirm_values)


def test_too_noisy_here_keeps_the_baseline_and_says_why():
    """Pairs spread 40% under load and 10 runs allowed: no interval to act on. The verdict says
    so with the spread and the load instead of printing 0.000-187959782."""
    machine = ScriptedMachine({"A": 1000.0, "B": 1000.0}, 0.40, random.Random(7))
    cfgs = configs("A", "B")
    plan = ConfirmPlan(1, 4, 10)
    loads = iter([3.1, 3.4, 4.2, 3.9, 3.5, 3.0, 3.3, 3.6, 3.8, 4.0])
    done = run_rounds(
        cfgs,
        plan,
        "throughput",
        machine.executor(cfgs),
        Rule("maximize", 0.1),
        load=lambda: next(loads),
    )
    record = {
        "configs": [vars(c) for c in cfgs],
        **compare(cfgs, "maximize", 0.1, 4, done.loads, steal_pct=12.4),
    }
    (entry,) = record["comparisons"]
    assert done.runs == 10 and entry["n_pairs"] == 5  # the cap, not the target, ended it
    assert entry["verdict"] == "too noisy" and entry["halfwidth"] > 0.10
    assert entry["ci_low"] < 1.0 < entry["ci_high"]
    assert Confirmation.from_attr(record).winner == 0
    text = speedup_text(Comparison.from_attr(entry))
    assert text.startswith("too noisy here:")
    assert "load 3.0-4.2 on" in text and f"spread {100 * entry['log_sd']:.1f}%" in text
    assert "12% of the CPU time taken by the hypervisor" in text
    assert f"~{entry['pairs_needed']} pairs" in text and "+-10.0%" in text
    assert "0.000" not in text and entry["pairs_needed"] > 5


def test_absurd_intervals_read_as_too_noisy_not_as_numbers():
    """Two pairs that disagree wildly (the 0.274x [0.000-187959782] report under contention)."""
    s = speedup([30.0, 400.0], [1000.0, 300.0])
    assert s.verdict == "too noisy" and s.distinguishable is False
    text = speedup_text(Comparison.from_attr({**vars(s), "distinguishable": s.distinguishable}))
    assert "+->100%" in text and "187959782" not in text


def test_stein_interval_uses_the_first_stage_spread():
    d = [0.05, -0.02, 0.08, 0.01, 0.03, 0.04, 0.02, 0.03]
    cand = [100.0 * math.exp(x) for x in d]
    s = speedup(cand, [100.0] * 8, first_stage=4)
    _, _, sd0 = mean_interval(d[:4])
    half = t_quantile(0.975, 3) * sd0 / math.sqrt(8)
    assert s.ratio == pytest.approx(math.exp(statistics.fmean(d)))
    assert math.log(s.ci_high / s.ratio) == pytest.approx(half)
    assert s.log_sd == pytest.approx(sd0)
    plain = speedup(cand, [100.0] * 8)  # a fixed number of rounds: the usual t-interval
    assert math.log(plain.ci_high / plain.ratio) == pytest.approx(mean_interval(d)[1])


def test_stein_pairs():
    # t(3) = 3.182: sd 0.1 for +-0.1 needs 10.1 -> 11 pairs; a quiet first stage is enough
    assert stein_pairs(0.1, 4, 0.1) == 11
    assert stein_pairs(0.01, 4, 0.1) == 4 and stein_pairs(0.0, 4, 0.1) == 4
    with pytest.raises(ValueError):
        stein_pairs(0.1, 1, 0.1)


def test_minimized_metric_pairs_invert():
    s = speedup([50.0, 51.0, 49.0], [100.0, 101.0, 99.0], direction="minimize")
    assert s.ratio == pytest.approx(2.0, rel=0.01) and s.verdict == "faster"


def test_failed_runs_leave_their_round_out_of_the_pairs():
    base = ConfirmedConfig("baseline", 0, {}, [], [100.0, 200.0, 100.0], [], [0, 1, 2])
    cand = ConfirmedConfig("candidate1", 1, {}, [], [110.0, 111.0], [], [0, 2])
    (entry,) = compare([base, cand], "maximize")["comparisons"]
    assert entry["n_pairs"] == 2 and entry["ratio"] == pytest.approx(math.sqrt(1.1 * 1.11))


@pytest.mark.parametrize(
    ("objective", "config", "lean"),
    [
        (
            "throughput",
            {"measure": {"ceiling": 1, "count_flops": 1, "peak_probe": 1, "loader_cost": 1}},
            True,
        ),
        (
            "utilization",
            {"measure": {"ceiling": 1, "count_flops": 1, "peak_probe": 1, "loader_cost": 1}},
            False,
        ),
        ("throughput", {"measure": {"ceiling": 1}}, False),  # a task without those keys
        ("throughput", None, False),
    ],
)
def test_lean_runs_only_where_the_objective_does_not_need_the_extras(objective, config, lean):
    assert bool(lean_overrides(objective, config)) is lean


def test_lean_overrides_replace_the_trials_own():
    out = with_overrides(
        ["measure.ceiling=true", "+x=1", "loader.batch_size=32"], ["measure.ceiling=false"]
    )
    assert out == ["+x=1", "loader.batch_size=32", "measure.ceiling=false"]
