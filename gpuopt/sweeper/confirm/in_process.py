"""The confirmation's in-process mode: how many windows the budget buys (`window_plan`), the
shared process with the baseline and its candidates built (`open_shared`), and its windows, each
on a build of its own (`fresh_build_windows`).

A long-lived process reads faster than a fresh one, but both sides of every pair are in it, so
the ratio is fair; the mode is recorded with the confirmation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpuopt.core.metrics import names
from gpuopt.core.shared_protocol import Failure
from gpuopt.study.configs import config_of
from gpuopt.study.keys import ATTR_OVERRIDES
from gpuopt.sweeper.comparison import Executor, Measurement
from gpuopt.sweeper.race.policy import shareable
from gpuopt.sweeper.shared_process import MIN_STEPS, SharedProcess, write_config

log = logging.getLogger("gpuopt.sweeper")

# Windows are cheap: a first stage with more df narrows Stein's interval. Each window on a build of
# its own spreads as builds do (mlp on the EPYC: a pair's log-sd ~0.1), so 16 rounds, not 8, keep
# a true 10% difference confirmed (docs/benchmarks.md, "Each window on a build of its own").
FIRST_STAGE_ROUNDS = 16
# ...as many of those rounds as fit in this many seconds of windows (a cnn's 3-step windows of
# 0.3 s steps: fewer); Stein's second stage adds rounds where needed.
FIRST_STAGE_S = 32.0
MAX_WINDOWS = 400
# What each arm's trial measured that its windows use: the epoch boundary (amortized as the trial
# did) and the data wait (a loader that keeps up is not drained before a window).
STEADY_FACTS = names(window="uses")


def window_seconds(trial: Any, window_s: float) -> float:
    """What one window of `trial`'s configuration takes, its drained step included."""
    step_ms = trial.user_attrs.get("step_time_ms")
    step_s = step_ms / 1000.0 if isinstance(step_ms, (int, float)) and step_ms > 0 else 0.0
    return max(window_s, MIN_STEPS * step_s) + step_s


def window_plan(
    rounds: int, max_runs: int, trial_seconds: Sequence[float], windows_s: Sequence[float]
) -> tuple[int, int]:
    """(first-stage rounds, cap on windows): the fresh-process cap's time (max_runs runs of the
    sweep's median trial) spent on windows; the first stage as many rounds as FIRST_STAGE_S holds
    (up to FIRST_STAGE_ROUNDS, at least `rounds`)."""
    median = sorted(trial_seconds)[len(trial_seconds) // 2] if trial_seconds else 10.0
    arms, round_s = len(windows_s), sum(windows_s)
    windows = int(max_runs * median / (round_s / arms))
    cap = max(2 * arms, min(MAX_WINDOWS, windows))
    fitting = int(FIRST_STAGE_S // round_s) if round_s > 0 else FIRST_STAGE_ROUNDS
    first = max(2, min(max(rounds, min(FIRST_STAGE_ROUNDS, fitting)), cap // arms))
    return first, cap


def open_shared(
    trials: Sequence[Any],
    labels: Sequence[str],
    compose: Callable[[list[str]], Any],
    objective: str,
    window_s: float,
    directory: Path,
) -> SharedProcess | None:
    """The shared process for these trials (baseline first), or None with the reason logged."""
    configs = [config_of(t.user_attrs) for t in trials]
    for label, config in zip(labels[1:], configs[1:], strict=True):
        why = shareable(configs[0], config)
        if why:
            log.info("confirmation in fresh processes: %s cannot share a process (%s)", label, why)
            return None
    paths, steady = {}, {}  # write_config makes the directory
    for label, trial in zip(labels, trials, strict=True):
        overrides = list(trial.user_attrs.get(ATTR_OVERRIDES) or [])
        paths[label] = write_config(compose(overrides), directory, f"{label}.yaml")
        steady[label] = {k: trial.user_attrs.get(k) for k in STEADY_FACTS}
    shared = SharedProcess.start(paths, steady, objective, window_s, directory)
    if shared.error:
        log.warning("confirmation in fresh processes: %s", shared.error)
        return None
    return shared


def fresh_build_windows(shared: SharedProcess) -> Executor:
    """Each window of an arm on a build of its own: its first on the build it started with, every
    later one rebuilt (released, built and warmed again) just before it. One build of a
    configuration reads apart from another (its place in memory: up to 25% on the Xeon), a bias
    that windows of one build share and their interval does not cover (5/60 A/A claims on the
    EPYC); rebuilt per window it is noise the pairs' spread covers (0/60; an mlp pair's log-sd
    ~0.1 where one build's windows read 0.02: docs/benchmarks.md)."""
    first_window = set(shared.members)

    def measure(label: str, job: int, so_far: Any) -> Measurement:
        if label in first_window:
            first_window.discard(label)
        else:
            config, steady = shared.members[label]
            built = shared.add(label, config, steady=steady)
            if isinstance(built, Failure):
                return Measurement(built.status, detail=built)
        return Measurement.of(shared.window(label))

    return measure
