"""The machine's limit for a workload, derived from measured per-sample costs (gpuopt.core.limits)."""

from __future__ import annotations

import pytest

from gpuopt.core import limits


def test_cpu_limit_shares_the_cores_between_loader_and_compute():
    # 2 cores, 150 us of loading and 50 us of compute per sample: 2 / 200 us = 10k samples/s.
    limit = limits.machine_limit("cpu", 2, 150e-6, 50e-6, ceiling=None)
    assert limit == limits.Limit(pytest.approx(10_000.0), "cores")
    # A cheaper loader raises the limit; so do more cores.
    assert limits.machine_limit("cpu", 2, 50e-6, 50e-6, None).throughput == pytest.approx(20_000.0)
    assert limits.machine_limit("cpu", 4, 150e-6, 50e-6, None).throughput == pytest.approx(20_000.0)


def test_accelerator_limit_is_the_ceiling_unless_the_loading_cores_cannot_feed_it():
    # 9 cores: one drives the device, 8 load at 100 us/sample -> 80k samples/s of input.
    assert limits.machine_limit("cuda", 9, 100e-6, None, ceiling=50_000.0) == limits.Limit(
        50_000.0, "compute"
    )
    fed = limits.machine_limit("cuda", 9, 100e-6, None, ceiling=200_000.0)
    assert fed == limits.Limit(pytest.approx(80_000.0), "loader")
    # One core still loads (the main process) when it is the only one.
    assert limits.machine_limit("cuda", 1, 1e-3, None, 1e9).throughput == pytest.approx(1_000.0)
    # No loader cost measured: the compute ceiling is all that is known.
    assert limits.machine_limit("cuda", 4, None, None, 7.0) == limits.Limit(7.0, "compute")


def test_the_limit_is_never_below_what_the_window_did():
    measured = limits.Limit(314.0, "cores")  # a replay slowed by the machine
    assert limits.at_least_achieved(measured, 368.0) == limits.Limit(368.0, "cores")
    assert limits.at_least_achieved(measured, 300.0) is measured
    assert limits.at_least_achieved(measured, None) is measured


def test_missing_costs_give_no_limit_and_efficiency_is_a_percentage():
    assert limits.machine_limit("cpu", 2, None, 50e-6, ceiling=1.0) is None
    assert limits.machine_limit("cpu", 2, 50e-6, None, ceiling=1.0) is None
    assert limits.machine_limit("cuda", 2, 50e-6, None, ceiling=None) is None
    assert limits.limit_efficiency(9_600.0, 10_000.0) == pytest.approx(96.0)
    assert limits.limit_efficiency(None, 10_000.0) is None
    assert limits.per_sample_cost(0.5, 1000) == pytest.approx(5e-4)
    assert limits.per_sample_cost(0.5, 0) is None
