"""The comparison service (gpuopt/sweeper/comparison.py) on scripted executors: the two orders,
the pairing each gives, the stops, the budget, failures, the calibration over a control build.
The confirmation's coverage and stop against ground truth: tests/test_confirm.py; the race's
screen through it: tests/test_race.py."""

from __future__ import annotations

import pytest

from gpuopt.sweeper.comparison import (
    BRACKETED,
    Budget,
    Compared,
    FixedCount,
    Measurement,
    PairStop,
    calibrated,
    compare,
    round_order,
)

B = "control"


class Scripted:
    """Reads each label at `truth[label]` x the machine's speed at that run (`speed[i]`, 1.0
    when absent); a label in `fails` gives no value."""

    def __init__(self, truth, speed=(), fails=(), last=()):
        self.truth, self.speed, self.fails, self.last = truth, list(speed), set(fails), set(last)
        self.runs: list[str] = []
        self.seen: list[int] = []  # how many readings the executor was shown before each run

    def __call__(self, label, job, so_far: Compared) -> Measurement:
        self.seen.append(so_far.runs)
        self.runs.append(label)
        if label in self.fails:
            return Measurement("oom")
        level = self.speed[job] if job < len(self.speed) else 1.0
        value = 100.0 * self.truth.get(label, 1.0) * level
        return Measurement("ok", value, last=label in self.last)


def _ratio(compared, label, direction="maximize"):
    speedup = compared.ratio(label, direction)
    return None if speedup is None else speedup.ratio


def test_rounds_alternate_their_order_so_no_arm_is_always_first():
    labels = ["A", "B1", "B2"]
    assert [x for r in range(3) for x in round_order(labels, r)] == [
        *("A", "B1", "B2"),
        *("B2", "B1", "A"),
        *("A", "B1", "B2"),
    ]
    executor = Scripted({"a": 2.0})
    done = compare(["a"], B, Budget(), FixedCount(3), executor, load=lambda: 0.0)
    assert executor.runs == [B, "a", "a", B, B, "a"] and done.rounds == 3
    assert executor.seen == list(range(6))  # the executor sees every reading before its run
    assert done.by_round("a") == {0: 200.0, 1: 200.0, 2: 200.0}
    assert _ratio(done, "a") == pytest.approx(2.0)


def test_bracketed_puts_the_control_on_both_sides_of_every_arm():
    executor = Scripted({})
    compare(["a", "b"], B, Budget(), FixedCount(1), executor, order=BRACKETED, load=lambda: 0.0)
    assert executor.runs == [B, "a", B, "b", B]


def test_an_arms_turn_is_several_short_readings_each_between_two_of_the_controls():
    executor = Scripted({"a": 2.0})
    done = compare(["a"], B, Budget(), FixedCount(1), executor, order=BRACKETED, turn=3)
    assert executor.runs == [B, "a", B, "a", B, "a", B] and done.rounds == 1
    speedup = done.ratio("a", "maximize")
    assert speedup.n_pairs == 3 and speedup.ratio == pytest.approx(2.0)
    # a reading that ends the arm's turn (read on its drain, or failed): the control after it
    # is read, the rest of the turn is not
    executor = Scripted({}, last={"a"}, fails={"b"})
    compare(["a", "b", "c"], B, Budget(), FixedCount(1), executor, order=BRACKETED, turn=2)
    assert executor.runs == [B, "a", B, "b", B, "c", B, "c", B]


def test_a_linear_drift_of_the_machine_cancels_in_a_bracketed_ratio():
    # the machine slows 10% per window; a is 2x the control, b 0.5x, at the moment they ran
    executor = Scripted({"a": 2.0, "b": 0.5}, speed=[1.0, 0.9, 0.81, 0.729, 0.6561])
    done = compare(["a", "b"], B, Budget(), FixedCount(1), executor, order=BRACKETED)
    assert _ratio(done, "a") == pytest.approx(2.0)
    assert _ratio(done, "b") == pytest.approx(0.5)
    (reading,) = done.of("a")
    assert done.neighbours(reading) == pytest.approx((100.0, 81.0))


def test_a_failed_measurement_has_no_value_and_its_neighbour_reads_on_one_side():
    executor = Scripted({"b": 3.0}, fails={"a"})
    done = compare(["a", "b"], B, Budget(), FixedCount(1), executor, order=BRACKETED)
    assert _ratio(done, "a") is None and done.of("a")[0].measurement.status == "oom"
    assert _ratio(done, "b") == pytest.approx(3.0)
    # the control failed after b: b reads over the one control window before it
    executor = Scripted({"b": 1.5})
    done = compare(
        ["b"], B, Budget(), FixedCount(1), _failing_last_control(executor), order=BRACKETED
    )
    (reading,) = done.of("b")
    assert done.neighbours(reading) == (100.0, None) and _ratio(done, "b") == pytest.approx(1.5)


def _failing_last_control(executor):
    def measure(label, job, so_far):
        if label == B and job > 0:
            return Measurement("error")
        return executor(label, job, so_far)

    return measure


def test_for_a_metric_where_lower_is_better_the_ratio_is_inverted():
    executor = Scripted({"a": 0.5})  # step time half the control's: 2x faster
    done = compare(["a"], B, Budget(), FixedCount(1), executor, order=BRACKETED)
    assert _ratio(done, "a", "minimize") == pytest.approx(2.0)


def test_the_budget_ends_before_a_round_it_cannot_hold_whole():
    executor = Scripted({"a": 1.0})
    done = compare(["a"], B, Budget(max_runs=5), FixedCount(10), executor, load=lambda: 0.0)
    assert done.runs == 4 and done.rounds == 2  # a third round (2 runs) would pass 5
    assert executor.runs == [B, "a", "a", B]


def test_pair_stop_gives_a_quiet_arm_no_more_rounds_and_a_beaten_one_none():
    """After the first stage: `a` is quiet (Stein's count is the first stage), `c` is read slower
    than `a` in every pair (beaten: it cannot be the answer). `p` is protected (a same-training
    candidate): only a protected rival beats it."""
    truth = {"a": 2.0, "c": 1.2, "p": 1.1}
    stop = PairStop("maximize", 0.10, first=4, protected=frozenset({"p"}))
    done = compare(["a", "c", "p"], B, Budget(), stop, Scripted(truth), load=lambda: 0.0)
    assert stop.beaten(done) == {"c": "a"}
    assert stop.wanted(done) == {"a": 4, "c": 4, "p": 4} and done.rounds == 4


def test_pair_stop_asks_noisy_arms_for_more_rounds_in_whole_cycles():
    noisy = [1.0, 1.2, 0.85, 1.1, 0.9, 1.25, 1.0, 0.8] * 10
    executor = Scripted({"a": 1.0}, speed=noisy)
    stop = PairStop("maximize", 0.05, first=4)
    done = compare(["a"], B, Budget(max_runs=200), stop, executor, load=lambda: 0.0)
    assert done.rounds > 4 and done.rounds % 2 == 0
    speedup = done.ratio("a", "maximize", target=0.05, first_stage=4)
    assert speedup is not None and speedup.n_pairs == done.rounds


def test_every_arms_ratio_is_read_over_the_control_build():
    """The control build (the control's configuration built as an arm) read 1.2x the control's
    windows: a build made now gains that much, so an arm read 1.2x is the control's equal; a
    failed arm stays without a ratio."""
    raw = {"#1": 1.2, "#2": 1.5, "#3": None, "ctl": 1.2}
    ratios, control = calibrated(raw, "ctl")
    assert control == 1.2 and set(ratios) == {"#1", "#2", "#3"}
    assert ratios["#1"] == pytest.approx(1.0) and ratios["#2"] == pytest.approx(1.25)
    assert ratios["#3"] is None
    # the control build's own window failed: the ratios as read, none of them its
    assert calibrated({"#1": 1.2, "ctl": None}, "ctl") == ({"#1": 1.2}, None)


def test_the_loads_and_each_reading_are_kept_in_run_order():
    loads = iter([1.0, 2.0, 3.0, 4.0])
    reported = []
    done = compare(
        ["a"],
        B,
        Budget(),
        FixedCount(2),
        Scripted({}),
        report=lambda reading, so_far: reported.append((reading.label, so_far.runs)),
        load=lambda: next(loads),
    )
    assert done.loads == [1.0, 2.0, 3.0, 4.0]
    assert [(r.label, r.round, r.job) for r in done.readings] == [
        (B, 0, 0),
        ("a", 0, 1),
        ("a", 1, 2),
        (B, 1, 3),
    ]
    assert reported == [(B, 1), ("a", 2), ("a", 3), (B, 4)]
