"""The search space: sweeper params as Hydra overrides, device-aware trimming, override text.

Pure functions over Hydra's override grammar, so they are tested by tables without running a sweep.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override, Transformer

from .objectives import SweepConfigError

log = logging.getLogger(__name__)

_PLAIN = re.compile(r"^[A-Za-z0-9_\-./:+@]+$")
_parser: OverridesParser | None = None


def parser() -> OverridesParser:
    global _parser
    if _parser is None:
        _parser = OverridesParser.create()
    return _parser


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


def canonical(value: Any) -> str:
    """How a choice is named in `gpuopt.env`'s poor_choices: true, null, 4, bf16."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).lower()


@dataclass
class Filtered:
    """The result of device-aware trimming of the preset's params."""

    params: dict[str, str]
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # (key, choice, reason)
    removed_keys: list[str] = field(default_factory=list)  # every choice was poor: not searched


def drop_poor_choices(
    params: Mapping[str, Any], poor_choices: Mapping[str, Mapping[str, str]]
) -> Filtered:
    """Remove the choices `gpuopt.env` flags as poor on this machine from choice() lists.

    A key whose every choice is poor is not searched at all (the configured value stays). Ranges,
    intervals and fixed values are left as written.
    """
    out: dict[str, str] = {}
    result = Filtered(params=out)
    poor_lower = {
        str(k): {str(c).lower(): str(r) for c, r in v.items()} for k, v in poor_choices.items() if v
    }
    for key, text in params.items():
        key, text = str(key), str(text)
        poor = poor_lower.get(key.lstrip("+~"))
        if not poor:
            out[key] = text
            continue
        override = parse_entry(key, text, "hydra.sweeper.params")
        value = override.value()
        if (
            not (override.is_choice_sweep() and isinstance(value, ChoiceSweep))
            or value.shuffle
            or value.tags
        ):
            out[key] = text
            continue
        kept = []
        for choice in override.sweep_iterator(transformer=Transformer.identity):
            reason = poor.get(canonical(choice))
            if reason is None:
                kept.append(choice)
            else:
                result.dropped.append((key, canonical(choice), reason))
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
    """Drop the preset's fixed (non-sweep) values for keys the user set on the command line.

    A preset may fix e.g. `measure.time_budget_s` for its trials; a user who wrote `measure=quick`
    or `measure.time_budget_s=5` on the command line meant theirs. Sweeps stay: a command-line
    sweep of the same key replaces the preset's anyway (it comes later).
    """
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
    """The baseline's values of the searched keys that fit the space, and the keys that do not.

    The baseline suggests only the fitting keys (so its trial params equal the configured values)
    and leaves the others as composed: either way it measures the user's configuration.
    """
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
