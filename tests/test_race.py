"""The race (gpuopt/sweeper/race/): when a sweep races, the screen's paired arithmetic, the shared
process's idle wait, and one real raced sweep end to end (pruned candidates recorded as such, the
finalists as whole trials of one process, the answer confirmed before it is published)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from gpuopt.core import knobs
from gpuopt.core.errors import SweepConfigError
from gpuopt.core.host import children_cpu_ticks, wait_for_idle_children
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_RACE,
    ATTR_REASON,
    STUDY_BATCH_RULE,
    STUDY_CONFIRMATION,
)
from gpuopt.study.records import IN_PROCESS
from gpuopt.sweeper import owners, resume
from gpuopt.sweeper.options import RaceOptions, SweeperOptions
from gpuopt.sweeper.race import policy
from tests.helpers.fixed_speed import FIXED_SPEED
from tests.helpers.interleave import group_members, probe_configs
from tests.helpers.sweep_outputs import sweep_identity

B = policy.BASELINE


def test_the_best_finalists_by_ratio_go_on() -> None:
    ratios = {"a": 1.2, "b": 3.0, "c": 0.4, "d": 2.5}
    assert policy.finalists(ratios, 2) == ["b", "d"]
    assert policy.rank_of("a", ratios) == 3


def test_only_contenders_at_the_floor_or_above_go_on() -> None:
    ratios = {"a": 0.95, "b": 0.7, "c": 0.89, "d": None}
    assert policy.finalists(ratios, 2, floor=0.9) == ["a"]  # c is below the floor, d unread
    assert policy.finalists(ratios, 2, floor=1.0) == []  # no contender: no whole trial
    assert policy.finalists(ratios, 2) == ["a", "c"]


def _raced(number: int, state: TrialState, ratio: float | None = None, **attrs: object) -> object:
    from optuna.trial import create_trial

    user_attrs: dict[str, object] = dict(attrs)
    if ratio is not None:
        user_attrs[ATTR_RACE] = {"ratio": ratio, "floor": 0.9, "rank": 1, "of": 2}
    values = [100.0] if state == TrialState.COMPLETE else None
    trial = create_trial(state=state, values=values, params={}, user_attrs=user_attrs)
    trial.number = number
    return trial


def test_the_summary_says_when_no_candidate_was_a_contender() -> None:
    baseline = _raced(0, TrialState.COMPLETE, **{ATTR_BASELINE: True})
    slow = [_raced(1, TrialState.PRUNED, 0.62), _raced(2, TrialState.PRUNED, 0.81)]
    note = policy.no_contender_note([baseline, *slow])
    assert note is not None and "no candidate read 0.9x the baseline" in note
    assert "#2, 0.81x" in note and "keep your configuration" in note
    finalist = _raced(3, TrialState.COMPLETE)  # a whole trial: the confirmation speaks
    assert policy.no_contender_note([baseline, *slow, finalist]) is None
    assert policy.no_contender_note([baseline]) is None  # nothing raced
    # a contender pruned only for rank (finalists=1): not this note
    assert policy.no_contender_note([baseline, _raced(4, TrialState.PRUNED, 1.3)]) is None


def test_a_just_built_candidate_gives_up_below_a_share_of_the_floor_of_the_baselines_window():
    window, give_up = {"throughput": 283.1}, policy.SCREEN_GIVE_UP
    assert policy.give_up_below("throughput_amortized", 0.9, window) == pytest.approx(
        give_up * 254.79
    )
    assert policy.give_up_below("throughput", 0.0, window) is None  # race.floor=0: no floor
    assert policy.give_up_below("step_time_ms", 0.9, window) is None  # a smaller batch can win
    assert policy.give_up_below("throughput", 0.9, {}) is None
    assert policy.give_up_below("throughput", 0.9, {"throughput": 0.0}) is None


def test_a_candidate_gives_up_on_its_drain_only_far_below_the_floor():
    window = {"throughput": 400.0}  # the baseline's last screen window
    assert policy.give_up_below("throughput_amortized", 0.9, window) == pytest.approx(
        policy.SCREEN_GIVE_UP * 0.9 * 400.0
    )
    assert policy.SCREEN_GIVE_UP < 1.0  # room for the baseline's drift between its windows
    assert policy.give_up_below("step_time_ms", 0.9, window) is None
    assert policy.give_up_below("throughput", 0.9, {"status": "error"}) is None


def test_a_race_without_a_contender_answers_keep_your_configuration(tmp_path: Path) -> None:
    from optuna.trial import create_trial

    from gpuopt.sweeper import outputs

    study = optuna.create_study(directions=["maximize"])
    study.add_trial(
        create_trial(
            state=TrialState.COMPLETE, values=[50.0], params={}, user_attrs={ATTR_BASELINE: True}
        )
    )
    race = {"ratio": 0.7, "floor": 0.9, "rank": 1, "of": 1}
    study.add_trial(create_trial(state=TrialState.PRUNED, params={}, user_attrs={ATTR_RACE: race}))
    text = outputs.write_outputs(study, sweep_identity(tmp_path), None, 1.0)
    assert "best      #0" in text  # the baseline is the answer
    assert "(the closest, #1, 0.70x): keep your configuration; nothing to confirm" in text


def test_a_pruned_candidates_reason_says_whether_the_floor_or_its_rank_stopped_it() -> None:
    from gpuopt.core.shared_protocol import Reading
    from gpuopt.sweeper.race.runner import Screened, prune_reason
    from gpuopt.sweeper.race.screen import Turn

    entry = Screened(trial=None, overrides=[], label="#1")  # type: ignore[arg-type]
    race = RaceOptions(finalists=2, floor=0.9)
    assert "below the race's floor of 0.9x: cannot be an answer" in prune_reason(
        entry, 0.5, 4, 9, race
    )
    assert "the best 2 went on" in prune_reason(entry, 1.4, 3, 9, race)
    window = Reading("#1", 1.0, 1.0, 1.0, steps=30, seconds=0.1)
    entry.turn = Turn(None)
    for _ in range(5):
        entry.turn.add(window)
    assert "0.50x the baseline in 5 windows of 0.1 s (rank 4" in prune_reason(
        entry, 0.5, 4, 9, race
    )
    entry.turn = Turn(Reading("#1", 1.0, 1.0, 1.0, steps=1, seconds=0.3, read_on_drain=True))
    assert "0.50x the baseline on its drain steps, its fastest" in prune_reason(
        entry, 0.5, 4, 9, race
    )


@pytest.mark.parametrize(
    ("key", "shares"),
    [
        ("loader.batch_size", True),
        ("precision", True),  # a config group whose options only change precision.*
        ("train.global_batch", True),
        ("device.num_threads", True),
        ("measure.time_budget_s", True),
        ("model", False),
        ("compile", False),
        ("cache", False),
        ("model.width", False),
        ("device.type", False),
    ],
)
def test_only_keys_the_shared_process_reapplies_can_race(key: str, shares: bool) -> None:
    assert knobs.shareable(key) is shares


class LocalLauncher:
    _EXECUTOR = "local"  # what hydra-submitit-launcher's local launcher says of itself


class BasicLauncher:
    pass


COMPOSED = {"engine": {"name": "native"}, "compile": {"mode": "off"}, "loader": {}}


def _why_not(**changes: object) -> str | None:
    given = {
        "options": SweeperOptions.build(gpuopt_task=True, baseline=True),
        "launcher": LocalLauncher(),
        "composed": COMPOSED,
        "space": SimpleNamespace(
            distributions={"loader.batch_size": None, "precision": None},
            fixed_params={"measure.time_budget_s": 2.0},
            fixed_overrides=["model=cnn", "device=cpu"],  # the same for every trial: may race
            is_grid=False,
        ),
        "objective": "throughput_amortized",
        "finished_trials": 0,
    }
    given.update(changes)
    return policy.why_not(**given)  # type: ignore[arg-type]


def test_the_default_space_of_gpuopts_own_task_races_whatever_it_fixes() -> None:
    assert _why_not() is None


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        (
            {"options": SweeperOptions.build(gpuopt_task=True, race={"enabled": False})},
            "race.enabled=false",
        ),
        (
            {"options": SweeperOptions.build(gpuopt_task=False, baseline=True)},
            "not gpuopt's own task",
        ),
        ({"options": SweeperOptions.build(gpuopt_task=True, baseline=False)}, "no baseline"),
        ({"options": SweeperOptions.build(gpuopt_task=True, n_jobs=2)}, "n_jobs=2"),
        ({"launcher": BasicLauncher()}, "BasicLauncher runs the trials"),
        ({"finished_trials": 3}, "a resumed sweep"),
        ({"objective": "mfu"}, "mfu is not a window's reading"),
        ({"composed": {**COMPOSED, "compile": {"mode": "default"}}}, "torch.compile"),
        (
            {
                "space": SimpleNamespace(
                    distributions={"model": None},
                    fixed_params={},
                    fixed_overrides=[],
                    is_grid=False,
                )
            },
            "model cannot change inside one process",
        ),
    ],
)
def test_a_sweep_that_cannot_race_says_why(changes: dict, why: str) -> None:
    assert why in (_why_not(**changes) or "")


def test_only_values_measured_in_fresh_processes_keep_a_resumed_study_out_of_the_race() -> None:
    def trial(state: TrialState, **attrs: object) -> optuna.trial.FrozenTrial:
        values = [1.0] if state == TrialState.COMPLETE else None
        return optuna.trial.create_trial(state=state, values=values, user_attrs=attrs)

    raced = [trial(TrialState.COMPLETE, race={"seconds": 2.0}), trial(TrialState.PRUNED)]
    failed = trial(TrialState.FAIL)  # no value: nothing to mix
    assert policy.measured_apart([*raced, failed]) == 0
    assert policy.measured_apart([*raced, trial(TrialState.COMPLETE)]) == 1


def test_race_settings_are_checked_before_anything_runs() -> None:
    assert SweeperOptions.build(race={"finalists": 3}).race == RaceOptions(finalists=3)
    with pytest.raises(SweepConfigError, match=r"hydra.sweeper.race.finalists=0"):
        SweeperOptions.build(race={"finalists": 0})
    assert SweeperOptions.build(race={"screen": 4}).race.screen == 4
    with pytest.raises(SweepConfigError, match=r"hydra.sweeper.race.screen=0.*integer >= 1"):
        SweeperOptions.build(race={"screen": 0})
    assert SweeperOptions.build(race={"floor": 0}).race.floor == 0
    with pytest.raises(SweepConfigError, match=r"hydra.sweeper.race.floor=-1.*\[0, 10\]"):
        SweeperOptions.build(race={"floor": -1})
    assert SweeperOptions.build(race={"slices": 3}).race.slices == 3
    with pytest.raises(SweepConfigError, match=r"hydra.sweeper.race.slices=0.*integer >= 1"):
        SweeperOptions.build(race={"slices": 0})
    with pytest.raises(SweepConfigError, match=r"hydra.sweeper.race.rungs"):
        SweeperOptions.build(race={"rungs": 2})


def test_the_wait_for_idle_workers_ends_once_they_stop_using_cpu() -> None:
    # a child that computes for 0.4 s of CPU, then sleeps: the wait outlasts the computing, then
    # ends. Its quiet span is 50 clock ticks: a computing child that other processes on the cores
    # (a CPU burner, other tests) leave under 2% of a core for half a second is all that could
    # look idle to it (0.1 s was 10 ticks: one tick per 10 ms of CPU, a child at 10% of a core)
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    child = subprocess.Popen([sys.executable, "-c", busy + "time.sleep(30)"])
    try:
        time.sleep(0.05)
        waited = wait_for_idle_children(max_s=20.0, quiet_s=0.5)
        after = children_cpu_ticks()
        time.sleep(0.2)
        assert children_cpu_ticks() == after  # idle when the wait returned
        assert waited < 20.0
        assert after is not None and after >= 0.3 * os.sysconf("SC_CLK_TCK")
    finally:
        child.kill()
        child.wait()


# ---- one real raced sweep -----------------------------------------------------------------------
# On a workload of fixed speed (tests/helpers/fixed_speed.py): a step sleeps 30 ms + 0.1 ms a
# sample, so a larger batch is faster by construction (32 -> ~960, 64 -> ~1,760, 256 -> ~4,600
# samples/s), whatever else runs on the cores, and equal batches read the same.
TINY_RACE = [
    *FIXED_SPEED,
    "hydra.sweeper.n_trials=4",
    "hydra.sweeper.race.window_s=0.05",
    "hydra.sweeper.race.slices=2",
    "hydra.sweeper.race.finalists=1",
    "hydra.sweeper.confirm.window_s=0.2",
    "hydra.sweeper.confirm.target_halfwidth=0.5",  # the protocol, not its precision: few rounds
    "hydra.sweeper.seeding=false",
    # batches above the baseline's 32 only: each candidate is faster than the baseline; no loader
    # workers (processes of their own, started again at each epoch); lr: a second knob that leaves
    # the speed as it is (6 configurations for the 6 candidates of the two runs)
    "hydra.sweeper.params={loader.batch_size: 'choice(64,128,256)', loader.num_workers: "
    "'choice(0)', precision: 'choice(fp32)'}",
    "optimizer.lr=choice(0.001,0.002)",
    "hydra.sweeper.device_params={}",
    "hydra.sweeper.race.floor=0",  # a finalist whatever the screen reads (the floor: unit tests)
    "device.num_threads=1",  # one compute thread everywhere: two collapse on a busy 2-core box
    "measure=quick",
    "measure.time_budget_s=0.3",
    "data.size=2048",  # 8+ steps an epoch: a loader's epoch boundary is no window of its own
]
ROOT = Path(__file__).resolve().parents[1]  # the trial processes import tests.helpers from here


def _counted(study: optuna.Study) -> list:
    """The study's trials that count towards n_trials (a sampled repeat of a measured
    configuration is void: not run, an unmeasured one instead)."""
    return [t for t in study.get_trials() if owners.counted(t)]


@pytest.mark.slow
def test_a_raced_sweep_prunes_in_the_study_and_confirms_its_answer(tmp_path: Path) -> None:
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path), "HYDRA_FULL_ERROR": "1"}
    cmd = [sys.executable, "-m", "gpuopt.run", "-m", "device=cpu", *TINY_RACE]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "race: the trials in one process" in done.stdout
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{tmp_path / 'gpuopt.db'}")
    trials = _counted(study)
    assert len(trials) == 4
    baseline = trials[0]
    assert baseline.user_attrs[ATTR_BASELINE] and baseline.state == TrialState.COMPLETE
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert len(complete) == 2 and len(pruned) == 2  # the baseline and one finalist
    for t in pruned:  # recorded as pruned, with what the screen read and why
        assert t.user_attrs["status"] == "pruned"
        race = t.user_attrs[ATTR_RACE]
        assert race["of"] == 3 and race["rank"] in (2, 3)
        assert math.isfinite(race["ratio"]) and race["window"]["throughput"] > 0
        assert t.user_attrs["config"]["loader"]["batch_size"] == t.params["loader.batch_size"]
        assert "raced out" in t.user_attrs["reason"]
    finalist = next(t for t in complete if t is not baseline)
    assert finalist.user_attrs[ATTR_RACE]["seconds"] > 0
    screen = finalist.user_attrs[ATTR_RACE]  # what the screen read of it, beside its whole trial
    assert screen["rank"] == 1 and screen["of"] == 3 and math.isfinite(screen["ratio"])
    assert screen["control"] > 0  # the round's control was built and read: ratios over it
    assert screen["ratio"] >= max(t.user_attrs[ATTR_RACE]["ratio"] for t in pruned)
    # the screen's best is the largest batch of the screen (fixed speeds: the fastest by
    # construction, tests/helpers/fixed_speed.py, so no two readings are compared here); a whole
    # trial with its extras
    batches = [t.params["loader.batch_size"] for t in trials[1:]]
    assert finalist.params["loader.batch_size"] == max(batches)
    assert finalist.user_attrs["profile"]
    # read over the baseline after the screen, in more windows, and told in the baseline's frame:
    # its window metrics the baseline's whole-trial value x that paired ratio, its own whole
    # trial's window reading kept beside
    paired = screen["paired"]
    assert paired["windows"] >= 1 and paired["throughput"]["ratio"] >= RaceOptions().floor
    low, high = paired["throughput"]["ci"]
    assert low <= paired["throughput"]["ratio"] <= high
    for name in ("throughput", "throughput_amortized"):  # the objective is the amortized one
        told = baseline.user_attrs[name] * paired[name]["ratio"]
        assert finalist.user_attrs[name] == pytest.approx(told)
    assert finalist.values[0] == pytest.approx(finalist.user_attrs["throughput_amortized"])
    assert screen["whole_window"]["throughput"] > 0
    # every whole trial ran in the race's one process: no launcher job of its own
    sweep_dir = Path(finalist.user_attrs["run_dir"]).parent
    assert (sweep_dir / "race" / "interleave.log").is_file()
    assert not (sweep_dir / ".submitit").exists()
    # the raced answer is confirmed before it is published: the finalist against the baseline
    confirmation = study.user_attrs[STUDY_CONFIRMATION]
    assert confirmation["mode"] == IN_PROCESS
    confirmed = [c["trial_number"] for c in confirmation["configs"]]
    assert confirmed == [baseline.number, finalist.number]
    assert "pruned 2" in done.stdout and "Confirmation:" in done.stdout

    # run again with a larger n_trials: the raced study races on (a new process, its baseline
    # reused), here in screens of 2, each round told before the next is asked
    more = [a for a in cmd if not a.startswith("hydra.sweeper.n_trials=")]
    more += ["hydra.sweeper.n_trials=7", "hydra.sweeper.race.screen=2"]
    again = subprocess.run(
        [*more, "hydra.sweeper.confirm.rounds=0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "race: the trials in one process" in again.stdout and "no race" not in again.stdout
    trials = _counted(study)
    assert len(trials) == 7 and sum(bool(t.user_attrs.get(ATTR_BASELINE)) for t in trials) == 1
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert all(ATTR_RACE in t.user_attrs for t in complete)  # no fresh-process value among them
    first_round, second_round = trials[4:6], trials[6]
    assert [t.state for t in first_round].count(TrialState.PRUNED) == 1
    assert second_round.state == TrialState.COMPLETE  # the only one of its screen goes on
    assert second_round.datetime_start >= max(t.datetime_complete for t in first_round)


@pytest.mark.slow
def test_the_race_process_builds_screens_drops_and_measures_whole_trials(tmp_path: Path) -> None:
    from gpuopt.core.shared_protocol import Window
    from gpuopt.sweeper.shared_process import SharedProcess

    paths = probe_configs(
        tmp_path, {"base": [], "big": ["loader.batch_size=256", "loader.num_workers=1"]}
    )
    race = SharedProcess.open(tmp_path / "race", "throughput", 0.2)
    try:
        assert race.add("base", paths["base"]).status == "ok"
        built = race.add("big", paths["big"])
        assert built.status == "ok" and built.config["loader"]["batch_size"] == 256
        assert len(group_members(race.process.pid)) == 2  # the process and big's worker
        # just built (its warm-up ran last) and its drain slower than asked for: read on it
        hopeless = race.measure("big", 0.2, 3, settle=False, give_up_below=1e12)
        assert hopeless.read_on_drain and hopeless.steps == hopeless.drained >= 1
        assert race.measure("base", 0.2, 3).status == "ok"
        # ...but never after another configuration's steps (cold caches: no upper bound)
        cold = race.measure("big", 0.2, 3, settle=False, give_up_below=1e12)
        assert not cold.read_on_drain and cold.steps >= 3
        # a window cut short by its deadline: one step at least, far fewer than asked for
        short = race.command(Window("big", window_s=0.0, min_steps=10**6, deadline_s=0.2), 60)
        assert short.status == "ok" and 1 <= short.steps < 10**6
        race.drop("big")
        assert len(group_members(race.process.pid)) == 1  # its worker gone with it
        assert race.measure("big", 0.2, 3).status == "error"  # dropped: no such member
        whole = race.whole_trial("#1", paths["big"], tmp_path / "trial_1")
        assert whole is not None
        assert (
            whole.ok
            and whole.metrics.throughput > 0
            and whole.config["loader"]["batch_size"] == 256
        )
        assert (tmp_path / "trial_1" / "result.json").is_file()
        assert race.measure("base", 0.2, 3).status == "ok"  # the others go on
    finally:
        race.close()
    assert group_members(race.process.pid) == []


def test_only_gpuopts_own_task_function_races() -> None:
    # an app on gpuopt's configs with a task of its own (tests/sweep_helpers/fake_task.py) must
    # not race: the race measures with gpuopt's engines, not the app's function
    import importlib.util

    origin = importlib.util.find_spec("gpuopt.run").origin
    namespace: dict = {}
    exec(compile("def main(cfg):\n    return cfg\n", origin, "exec"), namespace)
    assert policy.is_gpuopt_main(namespace["main"])  # the function gpuopt/run.py defines
    assert not policy.is_gpuopt_main(lambda cfg: cfg)
    assert not policy.is_gpuopt_main(test_only_gpuopts_own_task_function_races)


# ---- answer (a) in the race: a same-training finalist (issue 34) --------------------------------


def test_the_best_same_training_candidate_goes_on_when_no_finalist_keeps_the_training() -> None:
    ratios = {"big": 2.1, "bigger": 1.9, "same": 1.23, "same_slow": 1.05, "low": 0.7}
    keeps = {"same", "same_slow", "low"}
    assert policy.finalists(ratios, 2, 0.9, keeps) == ["big", "bigger", "same"]
    # one finalist serves both answers when the best overall keeps the training
    assert policy.finalists({**ratios, "same": 2.5}, 2, 0.9, keeps) == ["same", "big"]
    # never one the screen read below the floor
    assert policy.finalists(ratios, 2, 0.9, {"low"}) == ["big", "bigger"]
    assert policy.finalists(ratios, 2, 0.9) == ["big", "bigger"]


def _decided(batches_and_readings: list[tuple[int, int, float]]) -> tuple[list[str], optuna.Study]:
    """`RaceRunner._decide` on a study with a measured baseline (batch 32, no workers, 100
    samples/s in every baseline window) and one screened candidate per (batch, workers, reading):
    the finalists it keeps, the study after it told the others pruned. Fixed readings."""
    from gpuopt.core.shared_protocol import Reading
    from gpuopt.sweeper import global_batch, resume
    from gpuopt.sweeper.progress import Progress
    from gpuopt.sweeper.race.runner import RaceRunner, Screened
    from gpuopt.sweeper.race.screen import Turn
    from gpuopt.sweeper.space import build_search_space
    from gpuopt.sweeper.trials import TrialRunner

    space = build_search_space(
        {"loader.batch_size": "choice(32,256,512)", "loader.num_workers": "choice(0,1,2)"},
        [],
        None,
        grid=False,
    )
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(
        STUDY_BATCH_RULE, global_batch.gpuopt_rule({"loader.batch_size": 32}).to_attr()
    )
    study.enqueue_trial({"loader.batch_size": 32, "loader.num_workers": 0}, {ATTR_BASELINE: True})
    study.tell(study.ask(dict(space.distributions)), 100.0)
    screened = []
    for batch, workers, reading in batches_and_readings:
        study.enqueue_trial({"loader.batch_size": batch, "loader.num_workers": workers})
        trial = study.ask(dict(space.distributions))
        window = Reading("#", throughput=reading, throughput_amortized=reading,
                         step_time_ms=1.0, steps=3, seconds=0.3)  # fmt: skip
        turn = Turn(window, {})
        screened.append(Screened(trial, [], f"#{trial.number}", turn, reading / 100.0))
    runner = RaceRunner(
        TrialRunner(None, SweeperOptions.build(), None, 10, "", resume.Recovery(60))
    )
    progress = Progress(10, ["throughput"], ["maximize"], time.monotonic())
    chosen = runner._decide(study, screened, space, progress)
    return list(chosen), study


def test_the_race_keeps_a_same_training_finalist_and_records_which_candidates_keep_it() -> None:
    """The cnn sweep of issue 34: batch 32 with 2 workers screened 1.23x and was pruned behind two
    batch-256 candidates; now it goes on as a third whole trial, and the pruned candidate at the
    baseline's batch says it held the training (the summary's evidence for answer (a))."""
    chosen, study = _decided([(256, 1, 212.0), (512, 1, 190.0), (32, 2, 123.0), (32, 1, 110.0)])
    assert chosen == ["#1", "#2", "#3"]
    pruned = study.trials[4]
    assert pruned.state == TrialState.PRUNED
    assert pruned.user_attrs[ATTR_RACE]["same_training"] is True
    assert pruned.user_attrs[ATTR_RACE]["ratio"] == pytest.approx(1.1)
    # the best overall at the baseline's batch: one finalist serves both answers
    chosen, _ = _decided([(32, 2, 250.0), (256, 1, 212.0), (32, 1, 123.0)])
    assert chosen == ["#1", "#2"]


# ---- the round's control: built, read between baseline windows, dropped ---------------------------


class _ScriptedRace:
    """A race process that reads each label at a set throughput; `dies_on` a label's window
    ends the process (its `error` set, as a real one's is)."""

    def __init__(self, readings: dict[str, float], dies_on: str | None = None, step_s=None):
        self.readings, self.dies_on, self.error = readings, dies_on, None
        self.step_s = step_s or {}  # a label's window takes this long (one long step)
        self.calls: list[tuple[str, str]] = []

    def add(self, label, config, timeout_s=None):
        from gpuopt.core.shared_protocol import Added

        self.calls.append(("add", label))
        return Added(label, config={})

    def measure(self, label, window_s, min_steps, settle=True, give_up_below=None):
        from gpuopt.core.shared_protocol import Failure, Reading

        self.calls.append(("measure", label))
        if label == self.dies_on:
            self.error = "the race process died"
            return Failure(label, status="error", reason=self.error)
        value = self.readings[label]
        return Reading(label, throughput=value, throughput_amortized=value, step_time_ms=1.0,
                       steps=3, seconds=self.step_s.get(label, window_s))  # fmt: skip

    def drop(self, label):
        self.calls.append(("drop", label))


def _screened(race, dies_on=None, restarted=None):
    """race/screen.screen of the control build and candidate "#1" on a scripted race process:
    (the comparison, the executor)."""
    from gpuopt.sweeper.race import screen

    fresh = _ScriptedRace({policy.BASELINE: 90.0, "#1": 90.0})
    configs = {policy.CONTROL: Path("control.yaml"), "#1": Path("trial1.yaml")}
    lines = []
    compared, windows = screen.screen(
        race,
        configs,
        "throughput",
        RaceOptions(slices=2),
        lambda: restarted.append(fresh) or fresh,
        lambda label, turn, ratio: lines.append((label, ratio)),
    )
    return compared, windows, lines


def test_the_control_is_read_in_its_windows_each_between_two_baseline_windows_and_dropped():
    from gpuopt.sweeper.comparison import calibrated
    from gpuopt.sweeper.race import screen

    race = _ScriptedRace({policy.BASELINE: 100.0, policy.CONTROL: 80.0, "#1": 100.0})
    compared, windows, lines = _screened(race, restarted=[])
    assert windows.race is race
    ratios, control = calibrated(screen.raw_ratios(compared, "throughput"), policy.CONTROL)
    assert control == pytest.approx(0.8)  # candidates are read over 0.8x from here on
    assert ratios["#1"] == pytest.approx(1.25) and lines == [("#1", pytest.approx(1.25))]
    assert race.calls[:8] == [("measure", policy.BASELINE), ("add", policy.CONTROL),
                              ("measure", policy.CONTROL), ("measure", policy.BASELINE),
                              ("measure", policy.CONTROL), ("drop", policy.CONTROL),
                              ("measure", policy.BASELINE), ("add", "#1")]  # fmt: skip
    assert len(compared.of("#1")) == 2 and race.calls[-2:] == [
        ("drop", "#1"),
        ("measure", policy.BASELINE),
    ]


def test_a_candidate_of_long_steps_is_read_in_as_few_windows_as_its_turns_seconds_hold():
    """Two windows of 0.1 s are the turn; #1's first window took 0.3 s (steps longer than a
    window): its turn ends there, its reading that window's."""
    race = _ScriptedRace({policy.BASELINE: 100.0, policy.CONTROL: 100.0, "#1": 50.0},
                         step_s={"#1": 0.3})  # fmt: skip
    compared, windows, lines = _screened(race, restarted=[])
    assert len(compared.of(policy.CONTROL)) == 2 and len(compared.of("#1")) == 1
    turn = windows.turns["#1"]
    assert turn.window.seconds == pytest.approx(0.3) and lines == [("#1", pytest.approx(0.5))]
    control = windows.turns[policy.CONTROL].window  # its two windows joined
    assert (control.steps, control.seconds, control.throughput) == (6, pytest.approx(0.2), 100.0)


def test_a_control_that_costs_the_process_leaves_the_round_uncalibrated():
    """The process died in the control's window: a new one (the baseline built first), its
    baseline window the next candidate's neighbour, and no control for the round."""
    from gpuopt.sweeper.comparison import calibrated
    from gpuopt.sweeper.race import screen

    restarted: list = []
    race = _ScriptedRace({policy.BASELINE: 100.0}, dies_on=policy.CONTROL)
    compared, windows, _ = _screened(race, restarted=restarted)
    assert restarted == [windows.race] and windows.race is not race
    (control,) = compared.of(policy.CONTROL)
    assert control.measurement.status == "slow"
    ratios, factor = calibrated(screen.raw_ratios(compared, "throughput"), policy.CONTROL)
    assert factor is None and ratios["#1"] == pytest.approx(1.0)  # 90 over the new 90s
    assert compared.neighbours(compared.of("#1")[0]) == (90.0, 90.0)


def test_the_screens_progress_line_gives_the_ratio_the_race_decides_on() -> None:
    """Read over the round's control, as `_decide` reads it: the log and the pruned trial's
    reason never disagree."""
    from gpuopt.core.shared_protocol import Reading
    from gpuopt.sweeper.race.runner import Screened, screen_line
    from gpuopt.sweeper.race.screen import Turn

    window = Reading("#3", throughput=200.0, throughput_amortized=200.0, step_time_ms=1.0,
                     steps=3, seconds=0.3)  # fmt: skip
    entry = Screened(SimpleNamespace(number=3), [], "#3", Turn(window, {}, 1.5), 2.5)
    line = screen_line(entry, 2, 9, "throughput_amortized")
    assert line == "race: screened 2/9 #3: throughput=200 (2.50x the baseline), built in 1.5 s"


def test_a_finalists_whole_trial_is_told_in_the_baselines_frame() -> None:
    """Its window metrics: the baseline's whole-trial value x its paired ratio over the baseline
    (over the round's control's), divided where lower is better; its own readings kept."""
    from gpuopt.core.result import Metrics, Status, TrialResult
    from gpuopt.core.stats import speedup
    from gpuopt.sweeper.race.runner import Screened, paired_line
    from gpuopt.sweeper.race.screen import Paired, over_baseline

    faster = speedup([110.0, 121.0], [100.0, 110.0], "maximize")  # 1.1x in both pairs
    quicker = speedup([9.0, 10.0], [9.9, 11.0], "minimize")  # 10% shorter steps: 1.1x
    paired = Paired({"throughput": faster, "step_time_ms": quicker, "throughput_amortized": None},
                    turn=None, control=1.0)  # fmt: skip
    measured = TrialResult(Status.OK, Metrics(throughput=90.0, step_time_ms=12.0))
    baseline = {"throughput": 200.0, "step_time_ms": 5.0, "throughput_amortized": 190.0}
    told, own = over_baseline(measured, baseline, paired)
    assert told.metrics.throughput == pytest.approx(220.0)
    assert told.metrics.step_time_ms == pytest.approx(5.0 / 1.1)
    assert told.metrics.throughput_amortized is None  # not measured: nothing to tell
    assert own == {"throughput": 90.0, "step_time_ms": 12.0}
    # over a control build that read 1.1x the baseline's windows: the finalist reads 1.0x
    calibrated = Paired({"throughput": faster}, turn=None, control=1.1)
    told, _ = over_baseline(measured, baseline, calibrated)
    assert told.metrics.throughput == pytest.approx(200.0)
    read = calibrated.to_json()["throughput"]
    assert read["ratio"] == pytest.approx(1.0) and read["pairs"] == 2
    entry = Screened(SimpleNamespace(number=4), [], "#4")  # type: ignore[arg-type]
    line = paired_line(entry, calibrated, "throughput")
    assert line.startswith("#4 read over the baseline in 0 windows: 1.00x")


def test_a_finalist_read_below_the_floor_over_the_baseline_is_pruned_without_a_whole_trial(
    tmp_path: Path,
) -> None:
    """The screen read #1 at 1.2x; its read over the baseline (4x the screen's windows) reads
    0.8x: pruned there, with that read in its `race` record; no whole trial is asked of the race
    process (the scripted one has none to give)."""
    from gpuopt.sweeper.progress import Progress
    from gpuopt.sweeper.race.runner import RaceRunner, Screened
    from gpuopt.sweeper.trials import TrialRunner

    race = _ScriptedRace({policy.BASELINE: 100.0, "#1": 80.0})
    runner = RaceRunner(
        TrialRunner(None, SweeperOptions.build(), None, 10, "", resume.Recovery(60))
    )
    runner.process, runner.directory = race, tmp_path  # type: ignore[assignment]
    study = optuna.create_study(direction="maximize")
    entry = Screened(study.ask(), [], "#1", config_file=tmp_path / "trial1.yaml")
    progress = Progress(10, ["throughput"], ["maximize"], time.monotonic())
    read = {"ratio": 1.2, "rank": 1, "of": 9, "floor": 0.9}
    runner._finalist(study, entry, read, None, progress)  # type: ignore[arg-type]
    (trial,) = study.get_trials()
    assert trial.state == TrialState.PRUNED
    assert trial.user_attrs[ATTR_REASON].startswith(
        "raced out: 0.80x the baseline in its 20 windows after the screen; below the race's "
        "floor of 0.9x"
    )
    paired = trial.user_attrs[ATTR_RACE]["paired"]
    assert paired["throughput"]["ratio"] == pytest.approx(0.8) and paired["windows"] == 20
    assert race.calls.count(("measure", "#1")) == 20 and race.calls[-2:] == [
        ("drop", "#1"),
        ("measure", policy.BASELINE),
    ]
