"""The fresh_process launcher's "still running" lines, on a real submitit job in its own process."""

from __future__ import annotations

import logging
import operator
import re
import time

from gpuopt.core._compat import local_executor_class
from gpuopt.sweeper.launchers import fresh_process
from gpuopt.sweeper.launchers.fresh_process import FreshProcessLauncher
from gpuopt.sweeper.launchers.submitit_base import TrialJob

LINE = re.compile(r"^trial #7 still running \((\d+):(\d\d) elapsed, timeout 60 s\)$")


def _wait(tmp_path, monkeypatch, caplog, interval, fn, *args):
    """Submit fn(*args) as the launcher does and wait for it with the launcher's own loop; the
    progress lines it logged and the seconds it waited."""
    monkeypatch.setattr(fresh_process, "PROGRESS_S", interval)
    executor = local_executor_class(fresh_process._start_controller)(folder=tmp_path)
    executor.update_parameters(timeout_min=2)
    t0 = time.monotonic()
    job = executor.submit(fn, *args)
    with caplog.at_level(logging.INFO, logger="gpuopt.sweeper"):
        FreshProcessLauncher(timeout_s=60).collect([TrialJob([], 7, 0, job=job)])
    waited = time.monotonic() - t0
    lines = [r.getMessage() for r in caplog.records if r.name == "gpuopt.sweeper"]
    return lines, waited


def test_a_running_trial_is_reported_every_interval_and_never_before_it(
    tmp_path, monkeypatch, caplog
):
    interval = 0.5
    lines, waited = _wait(tmp_path, monkeypatch, caplog, interval, time.sleep, 1.5)
    # the job ran >= 1.5 s after t0: lines at >= 0.5 s, >= 1.0 s at least; none before 0.5 s,
    # so at most one per whole interval waited
    assert 2 <= len(lines) <= int(waited / interval), (lines, waited)
    assert all(LINE.match(line) for line in lines), lines
    minutes, seconds = map(int, LINE.match(lines[-1]).groups())
    assert 60 * minutes + seconds <= round(waited)


def test_a_trial_that_ends_within_the_interval_prints_nothing(tmp_path, monkeypatch, caplog):
    lines, waited = _wait(tmp_path, monkeypatch, caplog, 120.0, operator.mul, 6, 7)
    assert waited < 120.0 and lines == []
