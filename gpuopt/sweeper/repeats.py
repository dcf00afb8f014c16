"""No blind repeats: a configuration already measured is never launched again as a new trial.

Samplers ask measured configurations again (TPE's startup, the race's screens: an A/A sweep asked
`seed=2` twice and read 4,397 and 5,478 samples/s); in a 10-trial budget that is a lost trial.
The study's sampler is wrapped (`NoRepeatSampler`) to draw every searched key at once, as Optuna
would, and a repeat of anything measured, running or queued is replaced by the nearest
unmeasured configuration (user attr `replaces`). A repeat that still runs (space exhausted, not
listable, or enqueued) is a replicate (`replicate_of`), pooled by the summary and the report.
Only where gpuopt measures the app, not on a grid nor with a custom_search_space."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState

from gpuopt.study.keys import ATTR_FIXED_PARAMS, ATTR_REPLACES
from gpuopt.study.noise import config_key
from gpuopt.study.rules import trial_status
from gpuopt.sweeper import record as record_

log = logging.getLogger("gpuopt.sweeper")

MAX_VALUES = 10_000  # a key with more values than this is not listed (as a continuous one)
MAX_CANDIDATES = 200_000  # configurations looked at for a replacement before giving up
# How a trial ended that says its configuration was not measured (it may run again)
NOT_MEASURED = ("void", "interrupted", "skipped")


def taken(trials: Sequence[Any], asked: Sequence[Any] = ()) -> dict[tuple, int]:
    """Every configuration the study measured, runs or has queued, by the first trial that has it
    (`trials` snapshot and the `asked` ones, not in it)."""
    found: list[tuple[int, dict[str, Any]]] = [(t.number, t.params) for t in asked]
    for trial in trials:
        if trial.state == TrialState.WAITING:
            found.append((trial.number, trial.system_attrs.get(ATTR_FIXED_PARAMS) or {}))
        elif trial.state != TrialState.FAIL or trial_status(trial) not in NOT_MEASURED:
            found.append((trial.number, trial.params))
    out: dict[tuple, int] = {}
    for number, params in sorted(found, key=lambda pair: pair[0]):
        if params:
            out.setdefault(config_key(params), number)
    return out


def replicate_of(trial: Any, held: dict[tuple, int]) -> int | None:
    """The first trial of `trial`'s configuration when another one has it (`taken`), else None."""
    first = held.get(config_key(trial.params))
    return None if first is None or first == trial.number else first


def values_of(distribution: BaseDistribution) -> list[Any] | None:
    """Every value a distribution holds, or None when they are too many to list."""
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    if isinstance(distribution, IntDistribution):
        count = (distribution.high - distribution.low) // distribution.step + 1
        if count <= MAX_VALUES:
            return list(range(distribution.low, distribution.high + 1, distribution.step))
    if isinstance(distribution, FloatDistribution) and distribution.step is not None:
        count = round((distribution.high - distribution.low) / distribution.step) + 1
        if count <= MAX_VALUES:
            return [distribution.low + i * distribution.step for i in range(count)]
    return None


def _by_distance(
    values: dict[str, list[Any]], params: dict[str, Any], draw: random.Random
) -> Iterator[dict[str, Any]]:
    """The configurations of the space, nearest to `params` first: one key changed, then two,
    ...; each distance's configurations in a seeded random order."""
    keys = sorted(values)
    for changed in range(1, len(keys) + 1):
        ring = []
        for chosen in itertools.combinations(keys, changed):
            others = [[v for v in values[k] if v != params.get(k)] for k in chosen]
            for picked in itertools.product(*others):
                ring.append({**params, **dict(zip(chosen, picked, strict=True))})
                if len(ring) > MAX_CANDIDATES:
                    break
        draw.shuffle(ring)
        yield from ring


def nearest_unmeasured(
    distributions: dict[str, BaseDistribution],
    params: dict[str, Any],
    held: dict[tuple, int],
    seed: int,
    keep: Sequence[str] = (),
) -> dict[str, Any] | None:
    """The unmeasured configuration nearest to `params` with the keys `keep` as they are, or
    None: none left, or the space cannot be listed (a continuous range) or is too large."""
    values = {k: [params[k]] if k in keep else values_of(d) for k, d in distributions.items()}
    if any(v is None for v in values.values()):
        return None
    listed = {k: v for k, v in values.items() if v is not None}
    for looked, candidate in enumerate(_by_distance(listed, dict(params), random.Random(seed))):
        if config_key(candidate) not in held:
            return candidate
        if looked >= MAX_CANDIDATES:
            return None
    return None


class NoRepeatSampler(optuna.samplers.BaseSampler):
    """The user's sampler, its draw of a whole configuration checked for a repeat first.
    `infer_relative_search_space` hands Optuna every searched key, so `sample_relative` draws them all
    at once, in the same order Optuna would (relative sample, then each independent one)."""

    def __init__(self, inner: optuna.samplers.BaseSampler, space: dict[str, BaseDistribution]):
        self.inner = inner
        self.space = dict(space)

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return dict(self.space)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        own = self.inner.infer_relative_search_space(study, trial)
        picked = dict(self.inner.sample_relative(study, trial, own)) if own else {}
        picked = {k: v for k, v in picked.items() if k in search_space}
        for name, distribution in search_space.items():
            if name not in picked:
                picked[name] = self.inner.sample_independent(study, trial, name, distribution)
        # Keys it was enqueued with are on purpose (they win over any draw): only the drawn
        # ones are replaced (a seed that fixes the batch and leaves the rest to the sampler).
        fixed = {
            k: v
            for k, v in (trial.system_attrs.get(ATTR_FIXED_PARAMS) or {}).items()
            if k in search_space
        }
        drawn = {**picked, **fixed}
        held = taken(study.get_trials(deepcopy=False))
        first = held.get(config_key(drawn))
        if first is None or first == trial.number:
            return picked
        instead = nearest_unmeasured(search_space, drawn, held, trial.number, keep=list(fixed))
        if instead is None:
            return picked  # nothing unmeasured left: it runs as a replicate (marked at its ask)
        asked = " ".join(f"{k}={v}" for k, v in drawn.items())
        record_.trial_attrs(study, trial, {ATTR_REPLACES: {"asked": asked, "repeat_of": first}})
        log.info(
            "trial #%d: the sampler asked #%d's configuration again (%s); an unmeasured one "
            "instead (%s)",
            trial.number,
            first,
            asked,
            " ".join(f"{k}={v}" for k, v in instead.items()),
        )
        return instead

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self.inner.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.inner.before_trial(study, trial)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()


def install(study: optuna.Study, space: dict[str, BaseDistribution]) -> None:
    """Wrap the study's sampler (once) so that it draws no repeat (NoRepeatSampler)."""
    if space and not isinstance(study.sampler, NoRepeatSampler):
        study.sampler = NoRepeatSampler(study.sampler, space)
