"""One trial's route, measured: from run.py's prepare step to the engine's start, every gpuopt module
is entered once (issue 33: validation bounced between the registry and three check modules; a
single run made 14 module entries into 7 modules, the workload's checks entered 4 times; now 9
entries into 9 modules).

`sys.setprofile` sees every call of a gpuopt function; a stop is a call from one gpuopt module
into another (third-party frames in between, OmegaConf's or Hydra's, are looked through). The
route is run once before it is traced, so no import's module code is on it. The leaf helpers any
step may use (the one error, the schemas, the catalogues, the host's facts) are read, not
visited: they must call no other module. The engine's `measure` is replaced by a stand-in that
ends the trace where the engine would start.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from hydra import compose, initialize_config_module

import gpuopt
from gpuopt import run
from gpuopt.engines import native
from tests.conftest import TINY_TRIAL

PACKAGE = str(Path(gpuopt.__file__).resolve().parent)
HELPERS = {
    "gpuopt.core.errors",
    "gpuopt.core.spec",
    "gpuopt.core.host",
    "gpuopt.core.knobs",
    "gpuopt.core.metrics",
}
Stop = tuple[str, str]  # (caller module, callee module)


def _module(frame: FrameType) -> str | None:
    """The gpuopt module whose function `frame` runs; None for others' code and module code."""
    code = frame.f_code
    if not code.co_filename.startswith(PACKAGE) or code.co_name == "<module>":
        return None
    return str(frame.f_globals["__name__"])


def _caller(frame: FrameType) -> str | None:
    """The module of the nearest gpuopt function up the stack."""
    back = frame.f_back
    while back is not None and _module(back) is None:
        back = back.f_back
    return _module(back) if back is not None else None


def traced(route: Callable[[], Any], started: list[bool]) -> list[Stop]:
    """Every call from one gpuopt module into another while `route` runs, until the engine's
    start (the stand-in for its `measure` clears the profile and sets `started`)."""
    stops: list[Stop] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and (callee := _module(frame)) is not None:
            caller = _caller(frame)
            if caller is not None and caller != callee:
                stops.append((caller, callee))

    started.clear()
    sys.setprofile(profile)
    try:
        route()
    finally:
        sys.setprofile(None)
    assert started, "the route never reached the engine"
    return stops


@pytest.fixture
def engine_start(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    started: list[bool] = []

    def measure(trial: Any, process_t0: float) -> None:
        sys.setprofile(None)
        started.append(True)
        raise RuntimeError("the engine starts here")  # an `error` result, nothing measured

    monkeypatch.setattr(native, "measure", measure)
    return started


def _configs(tmp_path: Path) -> tuple[Any, Any]:
    """The task's composed config, and the same with Hydra's node (what the callback sees)."""
    overrides = [*TINY_TRIAL, f"hydra.run.dir={tmp_path / 'run'}"]
    with initialize_config_module("gpuopt.conf"):
        task = compose("config", overrides=overrides)
        callback = compose("config", overrides=overrides, return_hydra_config=True)
    return task, callback


def assert_each_module_entered_once(stops: list[Stop]) -> None:
    route = [callee for _, callee in stops if callee not in HELPERS]
    entered = Counter(route)
    assert all(n == 1 for n in entered.values()), f"entered more than once: {entered}, {route}"
    leaves = {(a, b) for a, b in stops if a in HELPERS and b not in HELPERS}
    assert not leaves, f"helpers that call back into the route: {leaves}"
    # The validation route's entry points, each from its one caller.
    assert ("gpuopt.trial.prepare", "gpuopt.core.checks") in stops
    assert ("gpuopt.trial.devices", "gpuopt.core.checks.device") in stops
    assert stops[-1] == ("gpuopt.engines.registry", "gpuopt.engines._lifecycle")


def test_a_sweep_trial_enters_each_module_once_on_its_way_to_the_engine(tmp_path, engine_start):
    task, _ = _configs(tmp_path)
    run.run_config(task, multirun=True)  # the imports happen here, outside the trace
    stops = traced(lambda: run.run_config(task, multirun=True), engine_start)
    assert stops[0] == ("gpuopt.run", "gpuopt.trial.prepare")
    assert_each_module_entered_once(stops)


def test_a_single_run_prepares_in_its_callback_and_enters_each_module_once(tmp_path, engine_start):
    task, callback = _configs(tmp_path)

    def single_run() -> None:
        run.check_before_run(callback)  # ValidateBeforeRun.on_run_start, before the run dir
        run.run_config(task, multirun=True)  # the task measures what the callback prepared

    single_run()
    stops = traced(single_run, engine_start)
    assert stops[0] == ("gpuopt.run", "gpuopt.trial.prepare")
    assert ("gpuopt.run", "gpuopt.engines.registry") in stops
    assert_each_module_entered_once(stops)
    assert not (tmp_path / "run").exists()  # nothing created before Hydra creates it
