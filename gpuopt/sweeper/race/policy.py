"""When a sweep can race (`why_not`), which configurations may share one process (`shareable`:
the race's and the in-process confirmation's rule), and the race's arithmetic (torch-free).

A race needs every configuration of the space to share one process with the baseline, a fresh
study (values measured in a warm shared process must never meet values of fresh processes), one
worker on this machine, a first objective a window measures, and a baseline to pair every window
with.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from optuna.trial import TrialState

from gpuopt.core import knobs
from gpuopt.core._compat import submitit_executor_kind
from gpuopt.core.metrics import metric
from gpuopt.study.configs import flatten
from gpuopt.study.keys import ATTR_BASELINE, ATTR_RACE
from gpuopt.sweeper.confirm.schedule import WINDOW_OBJECTIVES

BASELINE = "baseline"
# What the screen ranks on, per first objective (a candidate's epoch boundary is not measured yet).
SCREEN_METRIC = {name: metric(name).screen or name for name in sorted(WINDOW_OBJECTIVES)}
# A just-built candidate whose drain steps (its fastest) read below this share of the floor x the
# baseline's last window is read on them: it cannot reach the floor (0.8: room for the baseline's
# drift between its two neighbour windows).
SCREEN_GIVE_UP = 0.8
# Untimed steps after a screened candidate is built (the whole trials warm up as configured).
SCREEN_WARMUP = "measure.warmup_steps=1"


def give_up_below(objective: str, floor: float, baseline_window: Mapping[str, Any]) -> float | None:
    """The screen's `give_up_below` (samples/s): SCREEN_GIVE_UP x the floor x the baseline's last
    window's throughput, for an objective screened on throughput (step_time_ms favours a smaller
    batch at a lower throughput: None), a window with it and a floor."""
    value = baseline_window.get("throughput")
    if SCREEN_METRIC.get(objective) != "throughput" or not isinstance(value, (int, float)):
        return None
    return SCREEN_GIVE_UP * floor * value if value > 0 and floor > 0 else None


def why_not(
    options: Any,
    launcher: Any,
    composed: Mapping[str, Any],
    space: Any,
    objective: str,
    finished_trials: int,
) -> str | None:
    """Why this sweep cannot race (one phrase for the log), or None when it can."""
    kind = submitit_executor_kind(launcher)
    checks = (
        (not options.race.enabled, "hydra.sweeper.race.enabled=false"),
        (not options.gpuopt_task, "not gpuopt's own task"),
        (not options.baseline, "no baseline to pair windows with"),
        (options.n_jobs != 1, f"n_jobs={options.n_jobs}"),
        (
            kind != "local",
            f"{type(launcher).__name__} runs the trials (not one local process each)",
        ),
        (space.is_grid, "a grid sampler"),
        (
            finished_trials > 0,
            "the study holds trials measured in fresh processes (a resumed sweep)",
        ),
        (objective not in WINDOW_OBJECTIVES, f"{objective} is not a window's reading"),
    )
    for failed, why in checks:
        if failed:
            return why
    # only what is searched: fixed params and overrides are the baseline's too
    apart = [k for k in space.distributions if not knobs.shareable(k)]
    if apart:
        return f"{apart[0]} cannot change inside one process"
    return shareable(composed, composed)


def shareable(baseline: Mapping[str, Any], candidate: Mapping[str, Any]) -> str | None:
    """Why `candidate` cannot share a process with `baseline` (their stored spec dicts), or None."""
    if not baseline or not candidate:
        return "no resolved gpuopt trial config (a task of its own)"
    for config in (baseline, candidate):
        if (config.get("engine") or {}).get("name", "native") != "native":
            return "the Lightning engine builds its own loop"
        if (config.get("compile") or {}).get("mode", "off") != "off":
            return "torch.compile"
        if (config.get("distributed") or {}).get("kind", "none") != "none":
            return "a distributed trial starts its own ranks"
    a, b = flatten(dict(baseline)), flatten(dict(candidate))
    differing = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    # each member builds its own loader, model and optimizer; process-wide settings (threads,
    # matmul precision) are re-applied before each window (gpuopt.core.knobs)
    apart = [k for k in differing if not knobs.shareable(k)]
    return f"{apart[0]} differs" if apart else None


def measured_apart(trials: Sequence[Any]) -> int:
    """How many of a study's trials hold values measured outside a race: a study with any keeps
    fresh processes, so warm and fresh values never meet."""
    return sum(
        1 for t in trials if t.state == TrialState.COMPLETE and ATTR_RACE not in t.user_attrs
    )


def task_config(config: Any) -> dict[str, Any]:
    """The composed config without its `hydra` node, resolved; {} when it does not resolve here
    (then the sweep does not race)."""
    try:
        return {
            str(k): OmegaConf.to_container(config[k], resolve=True)
            if OmegaConf.is_config(config[k])
            else config[k]
            for k in config
            if k != "hydra"
        }
    except Exception:
        return {}


def is_gpuopt_main(task_function: Any) -> bool:
    """Whether the sweep's task is `gpuopt.run`'s own main (an app with its own task function on
    gpuopt's configs must not race). By its source file: under `python -m gpuopt.run` the module
    is `__main__`; located, not imported (it imports torch)."""
    code = getattr(task_function, "__code__", None)
    spec = importlib.util.find_spec("gpuopt.run")
    if code is None or spec is None or spec.origin is None:
        return False
    return Path(code.co_filename).resolve() == Path(spec.origin).resolve() and (
        getattr(task_function, "__name__", "") == "main"
    )


# The baseline's own configuration, built for the screen as a candidate is: each round's first
# screened entry. Why: where a configuration's tensors land in memory sets its speed on a CPU
# (4 KiB aliasing: the same configuration read up to 25% apart from one build to the next on a
# 2-core Xeon), so every candidate of a race read 0.80x, 1.00x or 1.23x the baseline by run in
# A/A screens (scripts/bench_aa.py). Every candidate's ratio is read over the control's
# (gpuopt.sweeper.comparison.calibrated).
CONTROL = "control"


def finalists(
    ratios: Mapping[str, float | None],
    count: int,
    floor: float = 0.0,
    same_training: Collection[str] = (),
) -> list[str]:
    """The `count` candidates with the highest ratio at `floor` or above, and, when none of them
    keeps the baseline's training, the best `same_training` one at the floor as one more (answer
    (a) is then confirmed, not pruned behind a larger batch). A candidate below the floor can be
    neither answer, so its whole trial (most of a raced sweep's time) would buy nothing."""
    ranked = sorted((r, label) for label, r in ratios.items() if r is not None and r >= floor)
    order = [label for _, label in reversed(ranked)]
    chosen = order[:count]
    if not any(label in same_training for label in chosen):
        chosen += [label for label in order if label in same_training][:1]
    return chosen


def rank_of(label: str, ratios: Mapping[str, float | None]) -> int | None:
    """1 for the highest ratio; None for a candidate without one."""
    if ratios.get(label) is None:
        return None
    return 1 + sum(1 for r in ratios.values() if r is not None and r > ratios[label])


def no_contender_note(trials: Sequence[Any]) -> str | None:
    """The summary's line when a race measured no candidate as a whole trial because none read
    its floor; else None."""
    whole = [
        t for t in trials if t.state == TrialState.COMPLETE and not t.user_attrs.get(ATTR_BASELINE)
    ]
    screened = [
        (t.user_attrs[ATTR_RACE]["ratio"], t.number, t.user_attrs[ATTR_RACE].get("floor"))
        for t in trials
        if t.state == TrialState.PRUNED
        and isinstance(t.user_attrs.get(ATTR_RACE), dict)
        and isinstance(t.user_attrs[ATTR_RACE].get("ratio"), (int, float))
    ]
    if whole or not screened:
        return None
    ratio, number, floor = max(screened)
    if not isinstance(floor, (int, float)) or ratio >= floor:
        return None
    return (
        f"race: no candidate read {floor:g}x the baseline or faster in its screen window (the "
        f"closest, #{number}, {ratio:.2f}x): keep your configuration; nothing to confirm"
    )
