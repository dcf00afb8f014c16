"""The sweeper's settings: one frozen, typed object built once from `hydra.sweeper.*`.

Each setting has exactly one default, here; plugin.py's ConfigStore node (what `hydra.sweeper`
composes to) takes its defaults from these classes, so the documented value, the composed value
and the value the loop runs with cannot disagree. `SweeperOptions.build` validates every value and
raises `SweepConfigError` (one line: key, value, what is allowed) before any trial runs.

Light on purpose: plugin.py imports this on every Hydra run (no optuna, no torch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuopt.core.errors import SweepConfigError

KEY = "hydra.sweeper"


# The most confirmation runs a sweep may make, as a share of its n_trials (confirm.max_share).
MAX_CONFIRM_SHARE = 4.0


@dataclass(frozen=True)
class ConfirmOptions:
    """End-of-sweep re-measurement: the baseline and the top-k candidates, interleaved in pairs
    (sweeper/confirm/: a paired log-ratio estimator, Stein's two-stage stop)."""

    top_k: int = 2  # candidates re-measured against the baseline
    # first stage: A B1 B2 rounds before their spread decides how many more; 0 turns it off
    rounds: int = 4
    # cap: confirmation runs <= this share of n_trials (fewer k until the first stage fits); the
    # default sweep's 10 runs = 5 pairs: +-10% when the pairs' log-ratios spread <= 7% (sd)
    max_share: float = 1.0
    # stop once the speedup's 95% CI is within +-this (relative); wider at the cap: "too noisy"
    target_halfwidth: float = 0.10
    # configurations that can share a process (gpuopt's task, DataLoader / batch / threads /
    # precision differences) are confirmed in alternating in-process windows of window_s seconds
    in_process: bool = True
    window_s: float = 0.5


@dataclass(frozen=True)
class RaceOptions:
    """The race (sweeper/race/): where every configuration of the space can share one process with
    the baseline (gpuopt's own task; DataLoader, batch, threads, precision), the trials are raced
    in that one process instead of one fresh process each: every candidate gets `slices` short
    windows, each between two baseline windows, the best `finalists` by that paired ratio are
    read over the baseline again and measured as whole trials in the same process (if they read
    `floor` of the baseline or faster), the others are recorded pruned. false: every trial in a fresh
    process (the protocol before the race)."""

    enabled: bool = True
    window_s: float = 0.1  # one screening window (at least one step however long it takes)
    # ...`slices` of them per candidate, each between two baseline windows (long steps: fewer,
    # to as many windows' seconds)
    slices: int = 5
    finalists: int = 2  # candidates measured as whole trials after each screen
    # ...of those the screen reads at this share of the baseline or faster (contenders; the rest
    # cannot be an answer): 0.9 leaves room for the screen's short windows' noise.
    floor: float = 0.9
    screen: int = 9  # candidates per screen: a longer sweep races in rounds of this many


@dataclass(frozen=True)
class SweeperOptions:
    """Every `hydra.sweeper` key, as the sweep loop reads it (see plugin.py for what each means)."""

    # Stock hydra-optuna-sweeper keys (sampler is instantiated separately).
    direction: Any = None
    storage: Any = None
    study_name: str | None = None
    n_trials: int = 20
    n_jobs: int = 1
    max_failure_rate: float = 0.5
    custom_search_space: str | None = None
    params: Mapping[str, str] | None = None
    # gpuopt additions
    objectives: tuple[str, ...] | None = None
    device_aware: bool = True
    device_params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Run the composed config first as the baseline. null (the default): on when gpuopt measures
    # the app (`measured`: gpuopt's own task, or objectives naming gpuopt's metrics), off for an
    # app whose objective is its own value (a stock config's sweep is the stock sweep).
    baseline: bool | None = None
    # The config is gpuopt's own (conf/config.yaml sets it): a derived default study name, and the
    # composed config checked once (gpuopt.core.checks.check_composed) before the study is opened.
    gpuopt_task: bool = False
    confirm: ConfirmOptions = field(default_factory=ConfirmOptions)
    race: RaceOptions = field(default_factory=RaceOptions)
    env_timeout_s: float = 120.0
    # The batch axis from two measured peaks (gpuopt/sweeper/memory_axis.py): on accelerators, and
    # on CPU when memory_cap_mb is set (MiB a trial may use; on an accelerator it caps the device).
    memory_axis: bool = True
    memory_cap_mb: float | None = None
    # After the baseline, enqueue the configurations an expert would try first (seeding.py).
    seeding: bool = True
    # gpuopt's own task: profile the baseline trial and (one extra run) the best (profiling.py).
    profile: bool = True
    # An app's keys whose product is its global batch per rank, the micro-batch first
    # ([data.batch_size, trainer.accumulate_grad_batches]): its sweep then seeds, races and
    # confirms the same-training answer at the baseline's global batch (global_batch.py). null:
    # gpuopt's own task knows its keys (the knob catalogue); an app's (a) is read after the fact.
    batch_keys: tuple[str, ...] | None = None
    # Each trial's result.json and trace.json.gz in Optuna's artifact store (artifacts.py): auto
    # (artifacts/ beside the study's file), a directory, or null (off).
    artifacts: str | None = "auto"
    heartbeat_interval: int | None = 60
    grace_period: int | None = None

    @classmethod
    def build(cls, **settings: Any) -> SweeperOptions:
        """From the sweeper config's keys (OmegaConf nodes or plain values); validated."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise SweepConfigError(f"{KEY}.{unknown[0]}", settings[unknown[0]], "a sweeper key")
        values = {k: _plain(k, v) for k, v in settings.items() if v is not None or k in _NULLABLE}
        confirm = values.pop("confirm", None) or {}
        if not isinstance(confirm, Mapping):
            raise SweepConfigError(f"{KEY}.confirm", confirm, f"a mapping of {_CONFIRM_KEYS}")
        confirm_keys = {f.name for f in dataclasses.fields(ConfirmOptions)}
        if set(confirm) - confirm_keys:
            extra = sorted(set(confirm) - confirm_keys)[0]
            raise SweepConfigError(f"{KEY}.confirm.{extra}", confirm[extra], _CONFIRM_KEYS)
        race = _nested(values.pop("race", None), RaceOptions, "race")
        if values.get("objectives") is not None:
            values["objectives"] = tuple(str(n) for n in values["objectives"])
        if values.get("batch_keys") is not None:
            values["batch_keys"] = _batch_keys(values["batch_keys"])
        options = cls(**values, confirm=ConfirmOptions(**confirm), race=race)
        if options.baseline is None:
            options = dataclasses.replace(options, baseline=options.measured)
        if not isinstance(options.baseline, bool):
            allowed = "true, false, or null (true where the objectives are gpuopt's metrics)"
            raise SweepConfigError(f"{KEY}.baseline", options.baseline, allowed)
        options.validate()
        options.validate_race()
        options.validate_artifacts()
        return options

    @property
    def measured(self) -> bool:
        """Whether gpuopt measures the app's task: its own task, or an app whose objectives name
        one of gpuopt's metrics (`throughput`, `data_wait`, ...). Such a sweep is fair by default:
        a baseline, trials in fresh processes (launcher_choice.py), a confirmation round."""
        from gpuopt.core.metrics import goals

        return self.gpuopt_task or any(n in goals() for n in self.objectives or ())

    def validate_artifacts(self) -> None:
        """hydra.sweeper.artifacts: auto, a directory, or null (gpuopt/sweeper/trial_artifacts.py)."""
        if self.artifacts is not None and not (isinstance(self.artifacts, str) and self.artifacts):
            raise SweepConfigError(
                f"{KEY}.artifacts",
                self.artifacts,
                "auto (artifacts/ beside the study's file), a directory, or null (off)",
            )

    def validate_race(self) -> None:
        """hydra.sweeper.race.*: the race's settings (sweeper/race/)."""
        for key, value, ok, allowed in (
            (
                "race.enabled",
                self.race.enabled,
                isinstance(self.race.enabled, bool),
                "true or false",
            ),
            (
                "race.window_s",
                self.race.window_s,
                _number_in(self.race.window_s, 0.02, 60.0),
                "seconds in [0.02, 60]",
            ),
            (
                "race.slices",
                self.race.slices,
                _int_at_least(self.race.slices, 1),
                "an integer >= 1",
            ),
            (
                "race.finalists",
                self.race.finalists,
                _int_at_least(self.race.finalists, 1),
                "an integer >= 1",
            ),
            (
                "race.floor",
                self.race.floor,
                _number_in(self.race.floor, 0.0, 10.0),
                "a ratio to the baseline in [0, 10] (0: every finalist goes on)",
            ),
            (
                "race.screen",
                self.race.screen,
                _int_at_least(self.race.screen, 1),
                "an integer >= 1",
            ),
        ):
            if not ok:
                raise SweepConfigError(f"{KEY}.{key}", value, allowed)

    def validate(self) -> None:
        for key, value, ok, allowed in (
            ("n_trials", self.n_trials, _int_at_least(self.n_trials, 1), "an integer >= 1"),
            ("n_jobs", self.n_jobs, _int_at_least(self.n_jobs, 1), "an integer >= 1"),
            (
                "max_failure_rate",
                self.max_failure_rate,
                _number_in(self.max_failure_rate, 0.0, 1.0),
                "a number in [0, 1]",
            ),
            (
                "confirm.rounds",
                self.confirm.rounds,
                _int_at_least(self.confirm.rounds, 0),
                "an integer >= 0 (0: off)",
            ),
            (
                "confirm.top_k",
                self.confirm.top_k,
                _int_at_least(self.confirm.top_k, 1),
                "an integer >= 1",
            ),
            (
                "confirm.max_share",
                self.confirm.max_share,
                _number_in(self.confirm.max_share, 0.0, MAX_CONFIRM_SHARE)
                and self.confirm.max_share > 0,
                f"a number in (0, {MAX_CONFIRM_SHARE:g}]",
            ),
            (
                "confirm.target_halfwidth",
                self.confirm.target_halfwidth,
                _number_in(self.confirm.target_halfwidth, 0.0, 1.0)
                and self.confirm.target_halfwidth > 0,
                "a number in (0, 1]",
            ),
            (
                "confirm.in_process",
                self.confirm.in_process,
                isinstance(self.confirm.in_process, bool),
                "true or false",
            ),
            (
                "confirm.window_s",
                self.confirm.window_s,
                _number_in(self.confirm.window_s, 0.1, 60.0),
                "seconds in [0.1, 60]",
            ),
            (
                "heartbeat_interval",
                self.heartbeat_interval,
                self.heartbeat_interval is None
                or self.heartbeat_interval == 0
                or _int_at_least(self.heartbeat_interval, 1),
                "seconds >= 1, or null / 0 (off)",
            ),
            (
                "grace_period",
                self.grace_period,
                self.grace_period is None or _int_at_least(self.grace_period, 1),
                "seconds >= 1, or null (2 x heartbeat_interval)",
            ),
            (
                "memory_cap_mb",
                self.memory_cap_mb,
                self.memory_cap_mb is None
                or (_number_in(self.memory_cap_mb, 0.0, math.inf) and self.memory_cap_mb > 0),
                "MiB > 0, or null (device memory; on CPU no cap: the preset's batch axis)",
            ),
            (
                "env_timeout_s",
                self.env_timeout_s,
                _number_in(self.env_timeout_s, 0.0, math.inf) and self.env_timeout_s > 0,
                "seconds > 0",
            ),
        ):
            if not ok:
                raise SweepConfigError(f"{KEY}.{key}", value, allowed)


_CONFIRM_KEYS = ", ".join(f.name for f in dataclasses.fields(ConfirmOptions))


def _batch_keys(given: Any) -> tuple[str, ...]:
    """hydra.sweeper.batch_keys: a non-empty list of config keys (global_batch.py)."""
    if isinstance(given, str) or not isinstance(given, (list, tuple)) or not given:
        raise SweepConfigError(f"{KEY}.batch_keys", given, "a list of config keys, or null")
    if not all(isinstance(k, str) and k.strip() for k in given):
        raise SweepConfigError(f"{KEY}.batch_keys", given, "a list of config keys, or null")
    return tuple(k.strip() for k in given)


def _nested(given: Any, kind: type, name: str) -> Any:
    """A nested settings object (`hydra.sweeper.race`) from its mapping; unknown keys refused."""
    given = given or {}
    keys = [f.name for f in dataclasses.fields(kind)]
    if not isinstance(given, Mapping):
        raise SweepConfigError(f"{KEY}.{name}", given, f"a mapping of {', '.join(keys)}")
    for extra in sorted(set(given) - set(keys)):
        raise SweepConfigError(f"{KEY}.{name}.{extra}", given[extra], ", ".join(keys))
    return kind(**given)


# Keys whose null means something (so a null given is kept, not replaced by the default).
_NULLABLE = frozenset(
    {"direction", "storage", "study_name", "custom_search_space", "params", "objectives"}
    | {"heartbeat_interval", "grace_period", "memory_cap_mb", "baseline", "artifacts", "batch_keys"}
)


def _plain(key: str, value: Any) -> Any:
    """OmegaConf containers -> plain dicts/lists. `params` stays as given: its values are read
    (and any interpolation resolved) when the sweep starts, as the stock sweeper reads them."""
    from omegaconf import OmegaConf

    if key == "params" or not OmegaConf.is_config(value):
        return value
    return OmegaConf.to_container(value)


def _int_at_least(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _number_in(value: Any, low: float, high: float) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        return False
    return low <= value <= high
