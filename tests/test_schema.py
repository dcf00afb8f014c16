"""The study schema (gpuopt/study/rules.py): one status rule, one feasibility rule, one baseline
and one best pick, for the sweeper, its summary and the report alike."""

from __future__ import annotations

import subprocess
import sys

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from gpuopt.study import keys
from gpuopt.study import rules as schema
from gpuopt.study.records import Confirmation


def trial(number, state=TrialState.COMPLETE, value=1.0, constraints=None, **attrs):
    system_attrs = {}
    if constraints is not None:
        system_attrs["constraints"] = list(constraints)
    t = create_trial(
        state=state,
        value=value if state == TrialState.COMPLETE else None,
        params={"b": number},
        distributions={"b": IntDistribution(0, 100)},
        user_attrs=attrs,
        system_attrs=system_attrs,
    )
    t.number = number
    return t


@pytest.mark.parametrize(
    ("state", "attrs", "status"),
    [
        (TrialState.COMPLETE, {"status": "ok"}, "ok"),
        (TrialState.COMPLETE, {"status": "oom"}, "oom"),
        (TrialState.COMPLETE, {"status": "diverged"}, "diverged"),
        (TrialState.COMPLETE, {}, "ok"),  # a stock task's trial written by hand
        (TrialState.FAIL, {"status": "error"}, "error"),
        (TrialState.FAIL, {}, "error"),
        (TrialState.FAIL, {"status": "void", "void": "surplus"}, "void"),
        (TrialState.FAIL, {"status": "error", "interrupted": True}, "interrupted"),
        (TrialState.RUNNING, {}, "running"),
        (TrialState.WAITING, {}, "waiting"),
        (TrialState.PRUNED, {}, "pruned"),
    ],
)
def test_trial_status(state, attrs, status):
    assert schema.trial_status(trial(0, state=state, **attrs)) == status


def test_status_counts_keep_first_seen_order():
    trials = [
        trial(0, status="ok"),
        trial(1, state=TrialState.FAIL, status="void", void="surplus"),
        trial(2, status="ok"),
    ]
    assert schema.status_counts(trials) == {"ok": 2, "void": 1}


def test_feasible_means_complete_with_values_and_no_violated_constraint():
    ok = trial(0, constraints=[0.0, 0.0])
    oom = trial(1, constraints=[1.0, 0.0])
    stock = trial(2)  # no constraints at all
    failed = trial(3, state=TrialState.FAIL)
    assert [schema.feasible(t) for t in (ok, oom, stock)] == [True, False, True]
    assert schema.feasible_trials([ok, oom, stock, failed]) == [ok, stock]


def test_baseline_pick_prefers_the_one_that_ran_ok():
    interrupted = trial(0, state=TrialState.FAIL, baseline=True, interrupted=True)
    rerun = trial(1, baseline=True, status="ok")
    other = trial(2, status="ok")
    assert schema.pick_baseline([interrupted, rerun, other]) is rerun
    assert schema.pick_baseline([interrupted, other]) is interrupted  # the last one flagged
    assert schema.pick_baseline([other]) is None


def test_best_pick_is_the_confirmed_winner_else_the_best_first_value():
    low, high = trial(0, value=10.0, baseline=True), trial(1, value=20.0)
    assert schema.pick_best([low, high], [], ["maximize"], None) is high
    assert schema.pick_best([low, high], [], ["minimize"], None) is low
    assert schema.pick_best([], [], ["maximize"], None) is None
    # a confirmation where no candidate is measurably faster: the baseline wins
    record = {
        "configs": [{"trial_number": 0}, {"trial_number": 1}],
        "comparisons": [{"trial_number": 1, "ratio": 1.02, "distinguishable": False}],
    }
    assert Confirmation.from_attr(record).winner == 0
    assert schema.pick_best([low, high], [], ["maximize"], Confirmation.from_attr(record)) is low
    record["comparisons"][0]["distinguishable"] = True
    assert schema.pick_best([low, high], [], ["maximize"], Confirmation.from_attr(record)) is high


def test_leading_trial_skips_infeasible_ones():
    oom = trial(0, value=99.0, constraints=[1.0])
    ok = trial(1, value=5.0, constraints=[0.0])
    assert schema.leading_trial([oom, ok], ["maximize"]) is ok


def test_plain_names():
    assert schema.plain_names(["value"]) and schema.plain_names(["value_0", "value_1"])
    assert not schema.plain_names(["throughput"]) and not schema.plain_names(None)


def test_attribute_keys_are_the_stored_format():
    """The strings are what existing studies hold: renaming one orphans them."""
    from gpuopt.core.result import ATTR_STATUS
    from gpuopt.study import storage
    from gpuopt.sweeper import resume

    assert schema.ATTR_BASELINE is keys.ATTR_BASELINE == "baseline"
    assert keys.ATTR_STATUS is ATTR_STATUS == "status"  # the result's own, named by its writer
    assert (keys.ATTR_OWNER, keys.ATTR_INTERRUPTED, keys.ATTR_VOID) == (
        "gpuopt:owner",
        "interrupted",
        "void",
    )
    assert (keys.ATTR_RERUN_OF, keys.STUDY_CONFIRM_CLAIM, keys.ATTR_HEARTBEAT) == (
        "rerun_of",
        "gpuopt:confirm_claim",
        "gpuopt:heartbeat",
    )
    assert resume.ATTR_OWNER is keys.ATTR_OWNER and resume.ATTR_VOID is keys.ATTR_VOID
    assert storage.ATTR_HEARTBEAT is keys.ATTR_HEARTBEAT


def test_schema_and_sweeper_do_not_import_torch():
    code = (
        "import sys; import gpuopt.study.rules, gpuopt.sweeper.loop, gpuopt.core.fmt, gpuopt.core.host; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_best_pick_agrees_with_optuna_on_a_real_study():
    study = optuna.create_study(direction="maximize")
    for number, v in enumerate((3.0, 7.0, 5.0)):  # three configurations (params b=0, 1, 2)
        study.add_trial(trial(number, value=v))
    pool = schema.feasible_trials(study.get_trials())
    assert schema.pick_best(pool, [], ["maximize"], None).number == study.best_trial.number
