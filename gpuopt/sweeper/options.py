"""The sweeper's settings: one frozen, typed object built once from `hydra.sweeper.*`.

Each setting has exactly one default, here (plugin.py's ConfigStore node takes its defaults from
these classes). Light on purpose: plugin.py imports this on every Hydra run."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuopt.core.errors import SweepConfigError
from gpuopt.core.stats import DEFAULT_TARGET

KEY = "hydra.sweeper"


# The most confirmation runs a sweep may make, as a share of its n_trials (confirm.max_share).
MAX_CONFIRM_SHARE = 4.0


@dataclass(frozen=True)
class ConfirmOptions:
    """End-of-sweep re-measurement: the baseline and the top-k candidates, interleaved in pairs
    (sweeper/confirm/: a paired log-ratio estimator, Stein's two-stage stop)."""

    top_k: int = 2
    rounds: int = 4
    max_share: float = 1.0  # the default sweep's 10 runs = 5 pairs
    target_halfwidth: float = DEFAULT_TARGET  # +-5%: set by the power wanted (core/stats)
    in_process: bool = True
    window_s: float = 0.5


@dataclass(frozen=True)
class RaceOptions:
    """The race (sweeper/race/): trials raced in one process, each candidate in `slices` windows
    between baseline windows; the best `finalists` (at `floor` of the baseline or faster) measured as
    whole trials, the others pruned. false: every trial in a fresh process."""

    enabled: bool = True
    window_s: float = 0.1  # at least one step however long it takes
    slices: int = 5  # long steps: fewer, to as many windows' seconds
    finalists: int = 2
    floor: float = 0.9  # leaves room for the screen's short windows' noise
    screen: int = 9


@dataclass(frozen=True)
class SweeperOptions:
    """Every `hydra.sweeper` key, as the sweep loop reads it (plugin.py's config node is made of
    these; docs/searching.md's "Sweeper keys" table says what each means)."""

    # Stock hydra-optuna-sweeper keys (sampler is instantiated separately).
    direction: Any = None
    storage: Any = None
    study_name: str | None = None
    n_trials: int = 20  # the study's TOTAL: a re-run resumes up to it
    n_jobs: int = 1
    max_failure_rate: float = 0.5  # `error` trials only, from the 3rd on
    custom_search_space: str | None = None
    params: Mapping[str, str] | None = None
    # gpuopt additions
    objectives: tuple[str, ...] | None = None
    device_aware: bool = True
    device_params: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    baseline: bool | None = None  # null: `measured`
    gpuopt_task: bool = False
    confirm: ConfirmOptions = field(default_factory=ConfirmOptions)
    race: RaceOptions = field(default_factory=RaceOptions)
    env_timeout_s: float = 120.0  # the env probe's limit (then no trimming)
    memory_axis: bool = True
    memory_cap_mb: float | None = None  # MiB a trial may use (on an accelerator: caps the device)
    seeding: bool = True
    profile: bool = True
    batch_keys: tuple[str, ...] | None = None
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
        # a null given is the default, except where null means off (a default of its own)
        values = {
            k: _plain(k, v) for k, v in settings.items() if v is not None or k in _OFF_BY_NULL
        }
        confirm = _nested(values.pop("confirm", None), ConfirmOptions, "confirm")
        race = _nested(values.pop("race", None), RaceOptions, "race")
        if values.get("objectives") is not None:
            values["objectives"] = tuple(str(n) for n in values["objectives"])
        if values.get("batch_keys") is not None:
            values["batch_keys"] = _batch_keys(values["batch_keys"])
        options = cls(**values, confirm=confirm, race=race)
        if options.baseline is None:
            options = dataclasses.replace(options, baseline=options.measured)
        if not isinstance(options.baseline, bool):
            allowed = "true, false, or null (true where the objectives are gpuopt's metrics)"
            raise SweepConfigError(f"{KEY}.baseline", options.baseline, allowed)
        options.validate()
        return options

    @property
    def measured(self) -> bool:
        """Whether gpuopt measures the app's task: its own task, or an app whose objectives name
        one of gpuopt's metrics (`throughput`, `data_wait`, ...). Such a sweep is fair by default:
        a baseline, trials in fresh processes (loop.py), a confirmation round."""
        from gpuopt.core.metrics import goals

        return self.gpuopt_task or any(n in goals() for n in self.objectives or ())

    def validate(self) -> None:
        c, r, int1 = self.confirm, self.race, "an integer >= 1"
        for key, ok, allowed in (
            ("n_trials", _int_at_least(self.n_trials, 1), int1),
            ("n_jobs", _int_at_least(self.n_jobs, 1), int1),
            ("max_failure_rate", _number_in(self.max_failure_rate, 0.0, 1.0), "a number in [0, 1]"),
            ("confirm.rounds", _int_at_least(c.rounds, 0), "an integer >= 0 (0: off)"),
            ("confirm.top_k", _int_at_least(c.top_k, 1), int1),
            (
                "confirm.max_share",
                _number_in(c.max_share, 0.0, MAX_CONFIRM_SHARE) and c.max_share > 0,
                f"a number in (0, {MAX_CONFIRM_SHARE:g}]",
            ),
            (
                "confirm.target_halfwidth",
                _number_in(c.target_halfwidth, 0.0, 1.0) and c.target_halfwidth > 0,
                "a number in (0, 1]",
            ),
            ("confirm.in_process", isinstance(c.in_process, bool), "true or false"),
            ("confirm.window_s", _number_in(c.window_s, 0.1, 60.0), "seconds in [0.1, 60]"),
            (
                "heartbeat_interval",
                self.heartbeat_interval in (None, 0) or _int_at_least(self.heartbeat_interval, 1),
                "seconds >= 1, or null / 0 (off)",
            ),
            (
                "grace_period",
                self.grace_period is None or _int_at_least(self.grace_period, 1),
                "seconds >= 1, or null (2 x heartbeat_interval)",
            ),
            (
                "memory_cap_mb",
                self.memory_cap_mb is None
                or (_number_in(self.memory_cap_mb, 0.0, math.inf) and self.memory_cap_mb > 0),
                "MiB > 0, or null (device memory; on CPU no cap: the preset's batch axis)",
            ),
            (
                "env_timeout_s",
                _number_in(self.env_timeout_s, 0.0, math.inf) and self.env_timeout_s > 0,
                "seconds > 0",
            ),
            ("race.enabled", isinstance(r.enabled, bool), "true or false"),
            ("race.window_s", _number_in(r.window_s, 0.02, 60.0), "seconds in [0.02, 60]"),
            ("race.slices", _int_at_least(r.slices, 1), int1),
            ("race.finalists", _int_at_least(r.finalists, 1), int1),
            (
                "race.floor",
                _number_in(r.floor, 0.0, 10.0),
                "a ratio to the baseline in [0, 10] (0: every finalist goes on)",
            ),
            ("race.screen", _int_at_least(r.screen, 1), int1),
            (
                "artifacts",
                self.artifacts is None or (isinstance(self.artifacts, str) and self.artifacts),
                "auto (artifacts/ beside the study's file), a directory, or null (off)",
            ),
        ):
            if not ok:
                value = functools.reduce(getattr, key.split("."), self)
                raise SweepConfigError(f"{KEY}.{key}", value, allowed)


def _batch_keys(given: Any) -> tuple[str, ...]:
    """hydra.sweeper.batch_keys: a non-empty list of config keys (global_batch.py)."""
    if (
        isinstance(given, str)
        or not isinstance(given, (list, tuple))
        or not given
        or not all(isinstance(k, str) and k.strip() for k in given)
    ):
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


_OFF_BY_NULL = ("heartbeat_interval", "artifacts")


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
