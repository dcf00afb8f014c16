"""Shared test fixtures: compose gpuopt's real Hydra config in-process."""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Callable, Iterator

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from gpuopt.core.spec import register_schemas
from tests.helpers.forked_cli import CliForks

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `-n 2` the workers (and the processes they start) share the cores: an OpenMP thread
    # that ends a parallel region sleeps at once instead of spinning for the next one (libgomp's
    # default), CPU the other worker was waiting for (~25% of a trial-heavy test's time here).
    # Only how idle threads wait; set before torch is imported, inherited by the tests'
    # subprocesses; a setting of the user's own is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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


_COMPOSED: dict[tuple[str, ...], DictConfig] = {}


def compose_config(*overrides: str) -> DictConfig:
    """The composed config, as `python -m gpuopt.run` would see it: a copy of its own for the
    caller to edit. Hydra composes each distinct override list once per process (~0.1 s each;
    several tests compose the same trial), failures each time they are asked for."""
    key = tuple(overrides)
    if key not in _COMPOSED:
        register_schemas()
        with initialize_config_module("gpuopt.conf"):
            _COMPOSED[key] = compose("config", overrides=list(overrides))
    return copy.deepcopy(_COMPOSED[key])


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """compose_cfg(*overrides) -> the composed config, as `python -m gpuopt.run` would see it."""
    return compose_config


@pytest.fixture(scope="session")
def cli_forks(tmp_path_factory) -> Iterator[CliForks]:
    """cli_forks.run(module, argv, cwd, env) -> `python -m module *argv`'s CompletedProcess, run
    in a process forked from one that has the CLIs' torch-free modules imported
    (tests/helpers/forked_cli.py): for the many short runs that end on bad input or read a study."""
    forks = CliForks(tmp_path_factory.mktemp("cli-forks"))
    yield forks
    forks.close()


def pytest_configure(config: pytest.Config) -> None:
    """Under `-n 2`, pytest-xdist's load scheduling hands out one test at a time to whichever worker
    is free (`--maxschedchunk=1`, unless given) instead of chunks of up to a quarter of the suite,
    which can leave one worker idle while the other works through its chunk. Set here, not in
    pyproject.toml's addopts: without pytest-xdist (the GPU machine, scripts/gpu_check.sh) the
    option would be an error."""
    if getattr(config.option, "maxschedchunk", "absent") is None:
        config.option.maxschedchunk = 1


# Modules whose module-scoped fixtures are expensive (a study database, a profiled trial, the
# Lightning runs, a CLI fork server), by group: under `-n 2` each group runs on one worker, so
# they are built once rather than once per worker. Every other test is still handed out alone.
ONE_WORKER_MODULES = {
    f"tests/{name}.py": name for name in ("test_bad_input", "test_lightning", "test_profile")
} | {  # these build studies from the same composed configs (a per-process cache): one worker
    f"tests/{name}.py": "report studies"
    for name in ("test_compare", "test_report", "test_report_cli", "test_report_page")
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's `load` scheduling, but each group of ONE_WORKER_MODULES is one unit of work
    (its tests in order on one worker); units keep the collection order (slow tests first). This
    scheduler (LoadScopeScheduling's) tops a worker up when it has 2 tests or fewer left, so
    pytest_configure's --maxschedchunk does not apply to it."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ONE_WORKER_MODULES.get(nodeid.split("::", 1)[0], nodeid)

    config.option.loadscopereorder = False
    return ModulesOnOneWorker(config, log)


def pytest_collectstart(collector: pytest.Collector) -> None:
    """No automatic garbage collection while the test modules are imported (each full collection
    walks all that torch, Lightning, Hydra and Optuna built so far: ~2 s of a worker's start)."""
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once the test modules are imported, move what they built out of the garbage collector's
    sight (`gc.freeze()`): it lives as long as the process anyway, and a full collection over it
    takes ~0.2 s here, which each in-process trial pays (gpuopt.engines._lifecycle.release calls
    `gc.collect()`). Objects the tests create later are collected as before."""
    gc.collect()
    gc.freeze()
    gc.enable()


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
