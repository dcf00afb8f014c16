"""What the sweep summary and the report say in words: the machine's limit and the two answers."""

from __future__ import annotations

from types import SimpleNamespace

from gpuopt.core.fmt import limit_share
from gpuopt.core.limits import HighestLimit, higher_elsewhere, highest_limit
from gpuopt.study.answers import Shown, TwoAnswers, two_answers
from gpuopt.study.records import Confirmation
from gpuopt.sweeper.summary import render

LIMIT = {"limit_efficiency": 91.74, "limit_throughput": 8262.4, "limit_bound": "cores"}


def test_limit_share_says_the_share_the_limit_and_its_bound():
    assert limit_share(LIMIT) == (
        "92% of this machine's limit for this workload (8,262 samples/s, bound by cores)"
    )
    slow = {"limit_efficiency": 100.9, "limit_throughput": 0.8741}
    assert limit_share(slow) == "101% of this machine's limit for this workload (0.874 samples/s)"
    assert limit_share({"limit_efficiency": 50.0}) is None  # no limit measured
    assert limit_share({"limit_efficiency": None, "limit_throughput": 10.0}) is None


def _trial(number: int, value: float, batch: int, **attrs: object) -> SimpleNamespace:
    return SimpleNamespace(
        number=number, values=[value], params={"loader.batch_size": batch}, user_attrs=attrs
    )


_RENDER = dict(
    study_name="s",
    storage=None,
    sweep_dir="/tmp/x",
    names=["throughput_amortized"],
    directions=["maximize"],
    counts={"ok": 2},
    pareto=[],
    confirmation=None,
    best_yaml=None,
    elapsed_s=1.0,
)


def test_sweep_summary_states_the_share_of_the_machines_limit():
    baseline = _trial(0, 3211.0, 32, limit_efficiency=94.5, limit_throughput=3397.7)
    best = _trial(2, 7551.0, 512, **LIMIT)
    text = render(**_RENDER, baseline=baseline, best=best)
    lines = text.splitlines()
    at_best = lines.index(next(line for line in lines if line.startswith("best ")))
    assert "at 92% of this machine's limit" in lines[at_best + 1]
    assert "(3,398 samples/s)" in text  # the baseline's own limit, no bound recorded

    # with the study's highest limit (outputs.write_outputs passes it): where more was measured
    text = render(
        **_RENDER, baseline=baseline, best=best, highest_limit=HighestLimit(8262.4, "cores", 2)
    )
    lines = text.splitlines()
    at_base = lines.index(next(line for line in lines if line.startswith("baseline ")))
    assert lines[at_base + 1].strip() == (
        "at 94% of this machine's limit for this workload (3,398 samples/s); other settings "
        "measured a limit up to 8,262 samples/s (trial #2)"
    )
    at_best = lines.index(next(line for line in lines if line.startswith("best ")))
    assert "other settings" not in lines[at_best + 1]  # its own limit is the highest


def test_a_baseline_at_its_own_limit_points_at_the_settings_with_a_higher_one():
    """The baseline's limit is at its settings (batch 32, 2 threads: 2,621 samples/s); other
    settings measured 7,173. "100% of the limit" alone would read as "nothing to gain"."""
    baseline = {"status": "ok", "throughput": 2612.0, "limit_efficiency": 99.7,
                "limit_throughput": 2621.0, "limit_bound": "cores"}  # fmt: skip
    best = {"status": "ok", "throughput": 6271.0, "limit_efficiency": 88.8,
            "limit_throughput": 7061.0, "limit_bound": "cores"}  # fmt: skip
    seed = {**best, "limit_throughput": 7173.0}
    failed = {"status": "oom", "limit_throughput": 99_999.0}
    highest = highest_limit([(0, baseline), (1, seed), (2, best), (3, failed)])
    assert highest == HighestLimit(7173.0, "cores", 1)  # only feasible trials count
    assert limit_share(baseline, highest) == (
        "100% of this machine's limit for this workload (2,621 samples/s, bound by cores); other "
        "settings measured a limit up to 7,173 samples/s (trial #1)"
    )
    assert limit_share(best, highest) == limit_share(best)  # within 5% of the highest: its own
    assert not higher_elsewhere(best, highest) and higher_elsewhere(baseline, highest)


def test_two_answers_name_each_confirmation_and_the_change():
    confirmation = Confirmation.from_attr({
        "comparisons": [
            {"trial_number": 4, "ratio": 1.5, "ci_low": 1.4, "ci_high": 1.6, "n_pairs": 6,
             "halfwidth": 0.067, "distinguishable": True, "verdict": "confirmed"}
        ]
    })  # fmt: skip
    b, a = Shown(4, "B", ("loader.batch_size=64",)), Shown(3, "A", ("loader.num_workers=2",))
    lines = two_answers(TwoAnswers("global batch 32", b, a, 0, confirmation, "batch 32 -> 64"))
    assert lines[1] == "  (a) same training: #3 A: not confirmed (single measurement)"
    assert lines[2] == "      change to apply: loader.num_workers=2"
    assert lines[3].startswith("  (b) best overall: #4 B: confirmed 1.500x")
    assert lines[4] == "      change to apply: loader.batch_size=64"
    assert lines[5] == "      changes the training: batch 32 -> 64"
    kept = TwoAnswers("global batch 32", Shown(0, "A"), Shown(0, "A"), 0, confirmation,
                      evidence="no trial held global batch 32")  # fmt: skip
    keep = two_answers(kept)
    assert keep[1] == (
        "  (a) same training: no same-training configuration is measurably faster: keep your "
        "configuration"
    )
    assert keep[2] == "      (no trial held global batch 32)" and "the same trial" in keep[3]
    assert "no feasible trial" in two_answers(TwoAnswers("g", b, None, 0))[1]
