"""Host facts without torch (gpuopt/core/host.py): the hypervisor's steal share from /proc/stat."""

from __future__ import annotations

import os
import sys

import pytest

from gpuopt.core import host


def test_steal_is_the_share_of_all_cpu_time_between_two_readings() -> None:
    before = dict.fromkeys(host._STAT_FIELDS, 100)
    after = {**before, "user": 180, "idle": 110, "steal": 110}  # +100 ticks, 10 of them stolen
    assert host.steal_percent(before, after) == pytest.approx(10.0)
    assert host.steal_percent(before, before) is None  # no time passed
    assert host.steal_percent(None, after) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_real_counters_count_this_process_user_time_as_user() -> None:
    """The fields are read in /proc/stat's order: the machine's user time (user + nice: a niced
    test run counts there) grew by at least what this process spent in user mode meanwhile; read
    off another column (system, steal, iowait: a few ticks) it would not have."""
    tick = os.sysconf("SC_CLK_TCK")
    first, ours = host.cpu_ticks(), os.times().user
    assert first is not None and set(first) == set(host._STAT_FIELDS)
    sum(i * i for i in range(4_000_000))  # ~0.2-0.4 s of CPU, all in user mode (no system call)
    second, ours = host.cpu_ticks(), os.times().user - ours
    user = (second["user"] + second["nice"]) - (first["user"] + first["nice"])
    assert ours * tick >= 5  # the loop's user time, as this process's own counter has it
    assert user >= ours * tick - 2, (user, ours * tick)  # 2 ticks: the two counters' rounding
    steal = host.steal_percent(first, second)
    assert steal is not None and 0.0 <= steal <= 100.0
