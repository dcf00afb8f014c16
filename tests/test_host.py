"""Host facts without torch (gpuopt/core/host.py): the hypervisor's steal share from /proc/stat."""

from __future__ import annotations

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
def test_the_real_counters_move_forward() -> None:
    first = host.cpu_ticks()
    assert first is not None and set(first) == set(host._STAT_FIELDS)
    sum(i * i for i in range(2_000_000))  # ~0.1 s of CPU
    second = host.cpu_ticks()
    assert sum(second.values()) > sum(first.values())
    steal = host.steal_percent(first, second)
    assert steal is not None and 0.0 <= steal <= 100.0
