"""The one error a bad configuration raises, in every process (key, bad value, what is allowed),
and the ways gpuopt raises it: a value outside a list, under a minimum or over a per-core cap; and
OmegaConf's schema errors (unknown key, wrong type) and Hydra's composition errors (a missing config,
an override the grammar or the config refuses: `python -m gpuopt.run`'s one line) in the same words.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf.errors import OmegaConfBaseException

from gpuopt.core.spec import PER_CPU_LIMIT, PER_CPU_LIMIT_FLOOR


class ConfigError(ValueError):
    """An invalid configuration: raised before any trial work starts."""

    what = "config"

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid {self.what}: {key}={value!r}; allowed: {allowed}")


class SweepConfigError(ConfigError):
    """A sweep setting that cannot work (a `hydra.sweeper` key, a sweep argument, the study's
    storage): raised before any trial runs. The one ConfigError of every process (the sweeper prints
    it as one line, exit status 2), whose line says it is the sweep's config that is wrong."""

    what = "sweep config"


class ConfigFileError(ConfigError):
    """A config file that is not valid YAML: names the file, line and column."""

    def __init__(self, path: str, line: int, column: int, problem: str) -> None:
        super().__init__(path, problem, "valid YAML")
        self.line, self.column = line, column
        self.args = (f"invalid config file: {path}, line {line}, column {column}: {problem}",)


def check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    """ConfigError unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ConfigError(key, value, " | ".join(allowed))


def check_min(key: str, value: Any, minimum: float, allowed: str | None = None) -> None:
    """ConfigError unless `value` is at least `minimum` (`allowed` says it in words)."""
    if value is None or value < minimum:
        raise ConfigError(key, value, allowed or f"a number >= {minimum}")


def per_cpu_limit(cpus: int) -> int:
    """The most loader workers (or compute threads, or ranks) accepted on `cpus` usable cores."""
    return max(PER_CPU_LIMIT * cpus, PER_CPU_LIMIT_FLOOR)


def check_per_cpu(key: str, value: int, minimum: int, cpus: int, what: str) -> None:
    """ConfigError unless `minimum <= value <= per_cpu_limit(cpus)` (a typo of 1000 workers)."""
    limit = per_cpu_limit(cpus)
    if not minimum <= value <= limit:
        raise ConfigError(
            key,
            value,
            f"an integer >= {minimum} and <= {limit} ({what}: at most {PER_CPU_LIMIT} per usable CPU "
            f"core, {cpus} here, or {PER_CPU_LIMIT_FLOOR})",
        )


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true | false",
    "str": "a string",
    "list[str]": "a list of strings",
    "list[int]": "a list of integers",
}


def _type_words(annotation: str) -> str:
    """`int | None` -> 'null or an integer': what a schema field accepts, in words."""
    parts = [part.strip() for part in str(annotation).split("|")]
    words = [_TYPE_WORDS.get(part, part) for part in parts if part != "None"]
    return ("null or " if "None" in parts else "") + " or ".join(words)


def _lookup(container: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(container, dict) or part not in container:
            return "?"
        container = container[part]
    return container


def config_error_from_omegaconf(
    exc: OmegaConfBaseException, values: dict[str, Any] | None = None
) -> ConfigError:
    """OmegaConf's schema errors (unknown key, wrong type) as one ConfigError: the allowed keys or
    the field's type from the schema dataclass, the bad value from `values`."""
    key = str(getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?")
    value = _lookup(values, key) if values is not None else "?"
    schema = getattr(exc, "object_type", None)
    fields = (
        {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    )
    name = key.rsplit(".", 1)[-1]
    if name in fields:
        return ConfigError(key, value, _type_words(fields[name].type))
    if fields:
        parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
        known = ", ".join(parent + n for n in fields)
        return ConfigError(key, value, f"a key of {schema.__name__}: {known}")
    return ConfigError(key, value, str(getattr(exc, "msg", exc)).splitlines()[0])


def to_schema(schema: type, values: dict[str, Any], prefix: str = "") -> Any:
    """`values` merged onto the schema dataclass, as one; OmegaConf's schema errors as a ConfigError
    (its key under `prefix`: `model.` for a model's schema)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as exc:
        error = config_error_from_omegaconf(exc, values)
        raise ConfigError(prefix + error.key, error.value, error.allowed) from None


def _parsed_overrides(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # the parse error itself is reported from Hydra's own exception
        return []


def _override_error(message: str, overrides: list[str], multirun: bool) -> ConfigError | None:
    """A composition error without an OmegaConf cause, pinned to the override it names."""
    for override in _parsed_overrides(overrides):
        key = override.key_or_group
        if f"'{key}" not in message:
            continue
        value = override.value() if not override.is_delete() else None
        if override.is_sweep_override() and not multirun:
            return ConfigError(
                key,
                override.input_line.split("=", 1)[-1],
                "one value in a single run (sweep with "
                "-m; a list is [a,b]; a string with commas is quoted)",
            )
        if override.is_add():
            return ConfigError(
                key, value, f"{key}=... without '+' (the key exists), or ++{key}=... to force it"
            )
        if override.is_delete():
            return ConfigError(key, "~", "deleting only a key or group the config has")
        return ConfigError(key, value, " ".join(message.split()))
    return None


def config_error_from_hydra(
    exc: BaseException, overrides: list[str], multirun: bool = False
) -> ConfigError | None:
    """Hydra's composition errors as one `ConfigError`, from their attributes; None for others."""
    import yaml
    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
        SearchPathException,
    )

    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return ConfigFileError(mark.name, mark.line + 1, mark.column + 1, str(exc.problem))
    if isinstance(exc, MissingConfigException):
        missing = exc.missing_cfg_file or "?"
        if exc.options is None:  # the primary config
            return ConfigError("--config-name", missing, "a config in the config search path")
        group, _, option = missing.rpartition("/")
        allowed = " | ".join(exc.options) or "no options found"
        return ConfigError(group, option, f"{allowed} (no {missing}.yaml in the search path)")
    if isinstance(exc, OverrideParseException):
        key, _, value = exc.override.partition("=")
        lines = exc.message.splitlines()  # the parser's reason is the second line
        reason = lines[1] if len(lines) > 1 else lines[0]
        return ConfigError(
            key,
            value,
            f"Hydra's override grammar ({' '.join(reason.split())}; see "
            "https://hydra.cc/docs/advanced/override_grammar/basic)",
        )
    if isinstance(exc, SearchPathException):
        return ConfigError(
            "--config-dir",
            str(exc).split("'")[1] if "'" in str(exc) else "?",
            "an existing directory",
        )
    if isinstance(exc.__cause__, OmegaConfBaseException):
        error = config_error_from_omegaconf(exc.__cause__)
        values = {o.key_or_group: o.value() for o in _parsed_overrides(overrides)}
        return ConfigError(error.key, values.get(error.key, error.value), error.allowed)
    if isinstance(exc, OmegaConfBaseException):
        return config_error_from_omegaconf(exc)
    if isinstance(exc, ConfigCompositionException):
        return _override_error(str(exc), overrides, multirun) or ConfigError(
            "overrides", " ".join(overrides), " ".join(str(exc).split())
        )
    return None
