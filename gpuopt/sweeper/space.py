"""The search space: sweeper params as Hydra overrides, device-aware trimming, override text."""

from __future__ import annotations

import functools
import logging
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override, Transformer
from hydra.utils import instantiate

from gpuopt.core import knobs
from gpuopt.core.errors import SweepConfigError

log = logging.getLogger(__name__)

Judge = Callable[[str, Any], str | None]  # (key, choice) -> why it is poor here, or None
_PLAIN = re.compile(r"^[A-Za-z0-9_\-./:+@]+$")


@functools.cache
def parser() -> OverridesParser:
    return OverridesParser.create()


def parse_entry(key: str, text: str, source: str) -> Override:
    """Parse one `key=value` sweep entry; a clear SweepConfigError when it is malformed."""
    line = f"{key}={text}" if text is not None else str(key)
    try:
        return parser().parse_override(line)
    except Exception as exc:
        raise SweepConfigError(
            f"{source}: {key}",
            text,
            "a Hydra sweep such as choice(32,64,128), range(1,9), interval(1e-4,1e-2), "
            f"tag(log,interval(...)) or a fixed value ({str(exc).splitlines()[0]})",
        ) from None


def choice_text(value: Any) -> str:
    """A value written so Hydra's override grammar reads it back as the same value and type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if _PLAIN.match(text):
        try:
            if parser().parse_override(f"k={text}").value() == text:
                return text
        except Exception:
            pass
    escaped = text.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


def override_text(key: str, value: Any) -> str:
    return f"{key}={choice_text(value)}"


@dataclass
class Filtered:
    """The result of device-aware trimming of the preset's params."""

    params: dict[str, str]
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # (key, choice, reason)
    removed_keys: list[str] = field(default_factory=list)  # every choice was poor: not searched


def drop_poor_choices(params: Mapping[str, Any], judge: Judge) -> Filtered:
    """Remove from choice() lists the choices `judge` calls poor here; a key whose every
    choice is poor is not searched at all (the configured value stays)."""
    out: dict[str, str] = {}
    result = Filtered(params=out)
    for key, text in params.items():
        key, text = str(key), str(text)
        override = parse_entry(key, text, "hydra.sweeper.params")
        value = override.value()
        plain = override.is_choice_sweep() and isinstance(value, ChoiceSweep)
        if not plain or value.shuffle or value.tags:
            out[key] = text
            continue
        kept = []
        for choice in override.sweep_iterator(transformer=Transformer.identity):
            reason = judge(key.lstrip("+~"), choice)
            if reason is None:
                kept.append(choice)
            else:
                result.dropped.append((key, knobs.canonical(choice), reason))
        if not kept:
            result.removed_keys.append(key)
            continue
        out[key] = (
            text
            if len(kept) == len(value.list)
            else "choice(" + ",".join(choice_text(c) for c in kept) + ")"
        )
    return result


def preset_without_user_keys(params: Mapping[str, str], user_keys: list[str]) -> dict[str, str]:
    """Drop the preset's fixed values for keys the user set on the command line (they meant
    theirs); sweeps stay, since a command-line sweep of the same key comes later and wins."""
    keys = [k.lstrip("+~") for k in user_keys]
    out = {}
    for key, text in params.items():
        bare = key.lstrip("+~")
        covered = any(
            bare == k or bare.startswith(k + ".") or bare.startswith(k + "/") for k in keys
        )
        if covered and not parse_entry(key, text, "hydra.sweeper.params").is_sweep_override():
            continue
        out[key] = text
    return out


def select_device_params(
    device_params: Mapping[str, Mapping[str, Any]] | None, device_type: str
) -> dict[str, str]:
    """The extra params a preset searches only on this device type (cpu | cuda | mps)."""
    if not device_params:
        return {}
    extra = device_params.get(device_type.split(":")[0]) or {}
    return {str(k): str(v) for k, v in extra.items()}


class _Missing:
    def __repr__(self) -> str:
        return "<not set>"


_MISSING = _Missing()


def current_value(config: Any, key: str) -> Any:
    """The value of a searched key in the composed config: group choice or config value."""
    from omegaconf import OmegaConf

    if key.startswith(("+", "~")):
        return _MISSING
    choices = config.hydra.runtime.choices if "hydra" in config else {}
    if key in choices:
        return choices[key]
    try:
        return OmegaConf.select(config, key, default=_MISSING, throw_on_missing=False)
    except Exception:
        return _MISSING


def fits(value: Any, distribution: Any) -> bool:
    """Whether a configured value is a point of an Optuna distribution (so it can be enqueued)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if value is _MISSING:
        return False
    if isinstance(distribution, CategoricalDistribution):
        return any(_same(value, c) for c in distribution.choices)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(distribution, IntDistribution):
        if not (
            isinstance(value, int) and is_number and distribution.low <= value <= distribution.high
        ):
            return False
        return (value - distribution.low) % (distribution.step or 1) == 0
    if isinstance(distribution, FloatDistribution):
        if not (is_number and distribution.low <= float(value) <= distribution.high):
            return False
        if distribution.step:
            steps = (float(value) - distribution.low) / distribution.step
            return math.isclose(steps, round(steps), abs_tol=1e-8)
        return True
    return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def baseline_params(
    config: Any, distributions: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The baseline's values of the searched keys that fit the space, and the keys that do not
    (left as composed: either way it measures the user's configuration)."""
    fitting: dict[str, Any] = {}
    outside: list[str] = []
    for key, distribution in distributions.items():
        value = current_value(config, key)
        if fits(value, distribution):
            from optuna.distributions import CategoricalDistribution

            if isinstance(distribution, CategoricalDistribution):
                value = next(c for c in distribution.choices if _same(value, c))
            fitting[key] = value
        else:
            outside.append(key)
    return fitting, outside


# ---- the sweep's space, built once per sweep ------------------------------------------------------


@dataclass
class SearchSpace:
    """What the sweep searches: Optuna distributions, the fixed params and overrides every trial
    gets, and the grid (GridSampler's values per key) when the sampler is a grid."""

    distributions: dict[str, Any]
    fixed_params: dict[str, Any]
    fixed_overrides: list[str]
    grid: dict[str, list[Any]] | None = None
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # device-aware trimming

    @property
    def is_grid(self) -> bool:
        return self.grid is not None

    @property
    def grid_size(self) -> int:
        """How many points GridSampler hands out: the product of the value counts per key."""
        return math.prod(len(v) for v in (self.grid or {}).values())


def build_search_space(
    preset: dict[str, str],
    arguments: list[str],
    judge: Judge | None,
    grid: bool,
    batch_axis: Any = None,  # memory_axis.BatchAxis (not imported: it imports this module)
) -> SearchSpace:
    """The preset's params (the batch axis from the memory model when given, memory_axis.py;
    device-trimmed by `judge` when given) plus the command line's sweep arguments (which
    always win), as Optuna distributions; SweepConfigError when malformed."""
    from gpuopt.core._compat import create_params_from_overrides, grid_choices

    for key, text in preset.items():
        parse_entry(key, text, "hydra.sweeper.params")
    dropped: list[tuple[str, str, str]] = []
    if batch_axis is not None and batch_axis.key in preset:
        preset = batch_axis.rewrite(preset)
        dropped += [(batch_axis.key, str(c), why) for c, why in batch_axis.dropped]
    if judge is not None:
        filtered = drop_poor_choices(preset, judge)
        for key, choice, reason in filtered.dropped:
            log.info("device-aware: dropped %s=%s from the search (%s)", key, choice, reason)
        for key in filtered.removed_keys:
            log.info(
                "device-aware: %s not searched (every choice is poor here); the configured value stays",
                key,
            )
        preset, dropped = filtered.params, dropped + filtered.dropped
    preset = preset_without_user_keys(preset, [_override_key(arg) for arg in arguments])
    params_conf = [f"{k}={v}" for k, v in preset.items()] + list(arguments)
    try:
        distributions, fixed_params, fixed_overrides = create_params_from_overrides(params_conf)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        raise SweepConfigError(
            "hydra.sweeper.params", params_conf, f"sweeps Optuna can sample ({exc})"
        ) from None
    for name in fixed_params:
        distributions.pop(name, None)
    space = SearchSpace(distributions, fixed_params, fixed_overrides, dropped=dropped)
    if grid:
        try:
            space.grid = {n: grid_choices(d) for n, d in distributions.items()}
        except (ValueError, AssertionError) as exc:
            raise SweepConfigError(
                "hydra.sweeper.sampler", "grid", f"discrete params only ({exc})"
            ) from None
    return space


def _override_key(arg: str) -> str:
    try:
        return parser().parse_override(arg).key_or_group
    except Exception as exc:
        raise SweepConfigError(
            "command line", arg, f"a Hydra override ({str(exc).splitlines()[0]})"
        ) from None


def validate_overrides(loader: Any, config: Any, space: SearchSpace) -> None:
    """Compose the trial config for every choice before any trial: unknown keys, bad group
    options and wrong types fail here with the override that caused them."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    columns: dict[str, list[Any]] = {}
    for name, dist in space.distributions.items():
        if isinstance(dist, CategoricalDistribution):
            columns[name] = list(dist.choices)
        elif isinstance(dist, (IntDistribution, FloatDistribution)):
            columns[name] = [dist.low, dist.high]
    fixed = [f"{k}={v}" for k, v in space.fixed_params.items()] + list(space.fixed_overrides)
    rows = max((len(v) for v in columns.values()), default=1)
    for i in range(rows):
        overrides = [override_text(k, v[i % len(v)]) for k, v in columns.items()]
        error = _compose_error(loader, config, overrides + fixed)
        if error is None:
            continue
        # Name the override at fault: each one alone (with the fixed ones) until one fails.
        culprit = next(
            ((o, e) for o in overrides if (e := _compose_error(loader, config, [o, *fixed]))),
            None,
        )
        if culprit is None:
            culprit = next(
                ((o, e) for o in fixed if (e := _compose_error(loader, config, [o]))),
                (" ".join(overrides + fixed), error),
            )
        raise SweepConfigError(
            "sweep override", culprit[0], f"keys and options of this config ({culprit[1]})"
        )


def _compose_error(loader: Any, config: Any, overrides: list[str]) -> str | None:
    """None if the trial config composes with these overrides, else the first lines of the error."""
    try:
        loader.load_sweep_config(config, overrides)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        return " ".join(lines[:3]) or type(exc).__name__
    return None


def suggest(trial: Any, name: str, distribution: Any) -> Any:
    """`trial.suggest_*` for a distribution object, through Optuna's public API (what the stock
    sweeper does with the private `trial._suggest`); a fixed param (enqueued) is returned as is."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    if isinstance(distribution, (IntDistribution, FloatDistribution)):
        is_int = isinstance(distribution, IntDistribution)
        draw = trial.suggest_int if is_int else trial.suggest_float
        return draw(
            name, distribution.low, distribution.high, step=distribution.step, log=distribution.log
        )
    raise TypeError(f"unsupported distribution for {name}: {distribution!r}")


# ---- hydra.sweeper.custom_search_space: the app's function that adds params to each trial ----
# The stock sweeper instantiates it with no execution whitelist, which Hydra 1.4 warns about (an
# error from 1.5). gpuopt trusts what the user already runs: the app's module and its package, plus
# `trust` for gpuopt's own task; anything else is instantiated as the stock sweeper does.


def app_modules(task_function: Any) -> list[str]:
    """Whitelist patterns for the app's module and package. A script's task lives in `__main__`,
    which Hydra's `_locate` imports again under its file name; `python -m pkg.app` names it `pkg.app`."""
    name = getattr(task_function, "__module__", None) or ""
    if name == "__main__":
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        path = getattr(main, "__file__", None)
        name = spec.name if spec is not None and spec.name else (Path(path).stem if path else "")
    if not name or name == "__main__":
        return []
    patterns = [f"{name}.*"]
    if "." in name:
        patterns.append(f"{name.rsplit('.', 1)[0]}.*")
    return patterns


def extender(
    target: str | None, task_function: Any, trust: Sequence[str] = ()
) -> Callable[[Any, Any], None] | None:
    """The custom_search_space function (a partial, called with the config and the trial)."""
    if not target:
        return None
    node = {"_target_": str(target), "_partial_": True}
    patterns = [*app_modules(task_function), *(str(p) for p in trust)]
    if any(target.startswith(p[:-1]) if p.endswith(".*") else target == p for p in patterns):
        return instantiate(node, _execution_whitelist_=patterns)
    return instantiate(node)  # the stock call: Hydra warns that nothing whitelists it
