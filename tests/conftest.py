"""Shared test fixtures: compose gpuopt's real Hydra config in-process."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from gpuopt.core.spec import register_schemas

# Verbatim copies of other projects' files (tests/third_party/README.md): their own test files are
# run by ours (tests/test_stock_plugin_suite.py) in a layout of their own, never collected here.
collect_ignore = ["third_party"]

# A trial small enough for unit tests: a few steps on a tiny model and cheap samples.
TINY_TRIAL = [
    "measure.warmup_steps=1",
    "measure.min_steps=3",
    "measure.max_steps=6",
    "measure.time_budget_s=0.5",
    "measure.ceiling_steps=2",
    "loader.batch_size=8",
    "data.size=64",
    "data.sample_cost=0.1",
    "device=cpu",
    "device.num_threads=1",  # tests share 2 cores with each other: no thread oversubscription
]


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """compose_cfg(*overrides) -> the composed config, as `python -m gpuopt.run` would see it."""
    register_schemas()

    def _compose(*overrides: str) -> DictConfig:
        with initialize_config_module("gpuopt.conf"):
            return compose("config", overrides=list(overrides))

    return _compose


def pytest_configure(config: pytest.Config) -> None:
    """Under `-n 2`, pytest-xdist's load scheduling hands out one test at a time to whichever worker
    is free (`--maxschedchunk=1`, unless given) instead of chunks of up to a quarter of the suite,
    which can leave one worker idle while the other works through its chunk. Set here, not in
    pyproject.toml's addopts: without pytest-xdist (the GPU machine, scripts/gpu_check.sh) the
    option would be an error."""
    if getattr(config.option, "maxschedchunk", "absent") is None:
        config.option.maxschedchunk = 1


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The end-to-end (`slow`) tests first, each group in pytest's own order: handed out one at a
    time (pytest_configure), the two workers start on the long tests and end on seconds-long unit
    tests, so neither waits idle for the other's last minute-long sweep."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def assert_cpu_peak(result):
    """A CPU trial's peak: measured (>= 0), or null with the note that says why (this test
    process's high-water mark, set by earlier tests, held above the trial's peak)."""
    from gpuopt.trial.memory import SHARED_PEAK_NOTE

    peak = result.metrics.peak_memory_mb
    assert (peak is None) == (SHARED_PEAK_NOTE in result.warnings)
    assert peak is None or peak >= 0
