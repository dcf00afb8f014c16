"""The confirmation's in-process mode: which configurations may share a process, the window budget,
and the real `python -m gpuopt.processes.shared_windows` process (gpuopt/processes/shared_windows.py) driven by the sweeper's
SharedProcess (gpuopt/sweeper/shared_process.py): windows, each on a build of its own in the
confirmation, failures as statuses, nothing left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from gpuopt.sweeper.confirm import in_process as interleaved
from gpuopt.sweeper.confirm.in_process import window_plan, window_seconds
from gpuopt.sweeper.race.policy import shareable
from gpuopt.sweeper.shared_process import SharedProcess
from tests.helpers.interleave import group_members, probe_configs

SPEC = {
    "engine": {"name": "native"},
    "compile": {"mode": "off"},
    "cache": {"empty_cache": "never"},
    "loader": {"batch_size": 32, "num_workers": 0},
    "precision": {"mode": "fp32"},
    "device": {"type": "cpu", "num_threads": None},
    "model": {"_target_": "gpuopt.workload.models.MLP", "width": 512},
    "measure": {"time_budget_s": 2.0},
    "profile": {"enabled": False},
}


def _with(**changes: dict) -> dict:
    return {**SPEC, **{k: {**SPEC[k], **v} for k, v in changes.items()}}


@pytest.mark.parametrize(
    ("candidate", "why"),
    [
        (_with(loader={"batch_size": 512, "num_workers": 2}), None),
        (_with(precision={"mode": "bf16"}, device={"num_threads": 1}), None),
        (_with(profile={"enabled": True}, measure={"time_budget_s": 9.0}), None),  # how, not what
        (_with(compile={"mode": "default"}), "torch.compile"),
        (_with(engine={"name": "lightning"}), "the Lightning engine builds its own loop"),
        (_with(cache={"empty_cache": "trial_end"}), "cache.empty_cache differs"),
        (_with(model={"width": 1024}), "model.width differs"),
        ({}, "no resolved gpuopt trial config (a task of its own)"),
    ],
)
def test_only_loader_batch_threads_and_precision_changes_share_a_process(candidate, why) -> None:
    assert shareable(SPEC, candidate) == why


def test_the_window_budget_is_the_fresh_process_caps_time() -> None:
    # 10 runs of a 12 s trial = 120 s: 120 windows of 1 s; first stage 16 rounds of 3 arms
    # where they fit in FIRST_STAGE_S, here 32 s // 3 s = 10 (at least confirm.rounds)
    assert window_plan(4, 10, [11.0, 12.0, 30.0], [1.0, 1.0, 1.0]) == (10, 120)
    assert window_plan(4, 10, [11.0, 12.0, 30.0], [0.5, 0.5, 0.5]) == (16, 240)
    assert window_plan(4, 10, [12.0], [3.0, 3.0, 3.0])[0] == 4  # slow windows: confirm.rounds
    assert window_plan(6, 10, [12.0], [3.0, 3.0, 3.0])[0] == 6
    # tiny trials: the cap still allows two rounds; the first stage fits the cap
    assert window_plan(2, 4, [0.5, 0.5], [1.0, 1.0]) == (2, 4)
    assert window_plan(4, 10, [12.0] * 3, [0.5, 0.5])[1] == 240
    assert window_plan(4, 400, [60.0], [0.1, 0.1]) == (16, interleaved.MAX_WINDOWS)


def test_a_window_of_slow_steps_lasts_its_minimum_steps() -> None:
    slow = SimpleNamespace(user_attrs={"step_time_ms": 400.0})  # MIN_STEPS + the drained one
    assert window_seconds(slow, 1.0) == pytest.approx(interleaved.MIN_STEPS * 0.4 + 0.4)
    fast = SimpleNamespace(user_attrs={"step_time_ms": 10.0})
    assert window_seconds(fast, 1.0) == pytest.approx(1.01)
    assert window_seconds(SimpleNamespace(user_attrs={}), 1.0) == 1.0
    # a slow arm takes the budget's time: fewer windows
    assert window_plan(4, 10, [12.0], [1.6, 1.01])[1] == int(120 / 1.305)


@pytest.mark.parametrize(
    ("step_s", "deadline_s", "expected"),
    [
        (0.01, None, 5),  # fast steps: min_steps and the window's length (0.05 s)
        (0.06, None, 3),  # slow steps, no deadline: min_steps however long
        (0.06, 0.1, 2),  # slow steps past the deadline: ends after the step that passed it
        (0.3, 0.1, 1),  # one step already past it: one step, never none
    ],
)
def test_a_screen_window_ends_after_one_step_past_its_deadline(
    step_s, deadline_s, expected, monkeypatch
):
    """WindowedTrial's step loop (the drain and the window both): until min_steps and the
    window's length, or once a deadline passed, after at least one step (on a scripted clock
    that each step advances)."""
    from gpuopt.engines import native
    from gpuopt.engines.native import WindowedTrial

    now = [0.0]
    monkeypatch.setattr(native.time, "perf_counter", lambda: now[0])

    def step(batch):
        now[0] += step_s

    windowed = WindowedTrial(
        None, SimpleNamespace(train_step=step), SimpleNamespace(next_step=lambda: None), None
    )
    assert windowed._steps(3, 0.05, deadline_s) == expected


@pytest.mark.parametrize(
    ("workers", "accumulation", "data_wait", "drained"),
    [
        (2, 1, None, 5),  # 2 workers x prefetch 2 queued while idle, then the step that re-warms
        (2, 2, None, 3),  # two micro-batches an optimizer step
        (2, 1, 3.0, 5),  # its trial waited for input: the queue would flatter the window
        (2, 1, 0.2, 1),  # its trial's loader kept up: a full queue is its steady state
        (0, 1, None, 1),  # no workers, nothing prefetched
    ],
)
def test_a_window_drains_what_the_idle_loader_prefetched_unless_it_keeps_up(
    workers, accumulation, data_wait, drained
):
    from gpuopt.engines.native import WindowedTrial

    loader = SimpleNamespace(num_workers=workers, prefetch_factor=None)
    trial = SimpleNamespace(spec=SimpleNamespace(loader=loader))
    workload = SimpleNamespace(accumulation_steps=accumulation)
    windowed = WindowedTrial(trial, workload, None, None, data_wait=data_wait)
    assert windowed.queued_steps() == drained
    # its own steps ran last in the process (its warm-up, its window): no re-warming step
    assert windowed.queued_steps(warm=True) == drained - 1


def test_only_the_configuration_whose_steps_ran_last_is_warm():
    from gpuopt.processes.shared_windows import Member, stepped

    members = {name: Member(name, built=object()) for name in ("baseline", "c1")}
    members["broken"] = Member("broken")  # failed to build: never warm
    stepped(members, "c1")
    assert [m.warm for m in members.values()] == [False, True, False]
    stepped(members, None)  # a whole trial ran in the process
    assert not any(m.warm for m in members.values())


@pytest.mark.slow
def test_windows_alternate_in_one_process_and_a_failed_member_is_a_status(tmp_path) -> None:
    arms = {
        "baseline": [],
        "candidate1": ["loader.batch_size=128", "loader.num_workers=1", "device.num_threads=1"],
        "candidate2": ["optimizer=sgd", "optimizer.lr=1e30"],  # diverges in its warm-up
    }
    # candidate1's trial measured its loader keeping up: no drain of its worker's queue
    steady = {"candidate1": {"epoch_steps": 10, "epoch_overhead_s": 1.0, "data_wait": 0.1}}
    shared = SharedProcess.start(
        probe_configs(tmp_path, arms), steady, "throughput_amortized", 0.2, tmp_path
    )
    assert shared.error is None, (tmp_path / "interleave.log").read_text()[-2000:]
    try:
        workers = group_members(shared.process.pid)
        assert len(workers) >= 2  # the process and candidate1's loader worker
        for _ in range(2):
            base, cand = shared.window("baseline"), shared.window("candidate1")
            assert base.status == cand.status == "ok"
            assert cand.user_attrs["steps"] >= interleaved.MIN_STEPS
            assert cand.user_attrs["seconds"] >= 0.2
            assert cand.user_attrs["drained"] == 1
            # the window's steady throughput, amortized over the measured epoch boundary
            step_s = cand.user_attrs["step_time_ms"] / 1000
            amortized = cand.user_attrs["throughput"] * 10 * step_s / (10 * step_s + 1.0)
            assert cand.values[0] == pytest.approx(amortized)
            assert base.values[0] == base.user_attrs["throughput"]  # no boundary given: steady
        # candidate1's own window ran last: its next one has not even the re-warming step
        assert shared.window("candidate1").user_attrs["drained"] == 0
        failed = shared.window("candidate2")
        assert failed.status == "diverged" and "NaN" in failed.user_attrs["reason"]
        assert shared.window("baseline").status == "ok"  # the others go on
        assert shared.window("nobody").status == "error"
        # The confirmation's executor: an arm's first window on the build it started with, each
        # later one on a build of its own (candidate1's loader worker is a new process then).
        measure = interleaved.fresh_build_windows(shared)
        started_with = set(group_members(shared.process.pid))
        assert measure("candidate1", 0, None).status == "ok"
        assert set(group_members(shared.process.pid)) == started_with
        rebuilt = measure("candidate1", 1, None)
        assert rebuilt.status == "ok"
        assert set(group_members(shared.process.pid)) - started_with  # a new worker
        attrs = rebuilt.detail.user_attrs  # its steady facts kept: amortized as before
        step_s = attrs["step_time_ms"] / 1000
        assert rebuilt.value == pytest.approx(attrs["throughput"] * 10 * step_s / (10 * step_s + 1))
        assert [measure("candidate2", job, None).status for job in (2, 3)] == ["diverged"] * 2
    finally:
        shared.close()
    assert shared.process.returncode == 0
    assert group_members(shared.process.pid) == []  # no worker left behind


@pytest.mark.slow
def test_a_killed_sweep_takes_its_shared_process_with_it(tmp_path) -> None:
    """The sweep dies with SIGKILL mid-confirmation: the shared process (parent-death signal)
    and its DataLoader workers end too."""
    paths = probe_configs(tmp_path, {"baseline": ["loader.num_workers=1"]})
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from gpuopt.sweeper.shared_process import SharedProcess
        shared = SharedProcess.start({{"baseline": Path({str(paths["baseline"])!r})}}, {{}},
                                     "throughput", 0.2, Path({str(tmp_path)!r}))
        assert shared.error is None, shared.error
        print(shared.process.pid, flush=True)
        time.sleep(600)
        """
    )
    sweep = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(sweep.stdout.readline())
        assert len(group_members(child)) >= 2
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait()
        deadline = time.monotonic() + 20
        while group_members(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(child) == []
    finally:
        if sweep.poll() is None:
            sweep.kill()
