"""The one error a bad configuration raises, in every process (key, bad value, what is allowed),
and the ways gpuopt raises it: a value outside a list or under a minimum, and OmegaConf's schema
errors (unknown key, wrong type) said in the same words.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """An invalid configuration: raised before any trial work starts."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid config: {key}={value!r}; allowed: {allowed}")


class ConfigFileError(ConfigError):
    """A config file that is not valid YAML: names the file, line and column."""

    def __init__(self, path: str, line: int, column: int, problem: str) -> None:
        super().__init__(path, problem, "valid YAML")
        self.line, self.column = line, column
        self.args = (f"invalid config file: {path}, line {line}, column {column}: {problem}",)

    def __str__(self) -> str:
        return str(self.args[0])


def check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    """ConfigError unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ConfigError(key, value, " | ".join(allowed))


def check_min(key: str, value: Any, minimum: float, allowed: str | None = None) -> None:
    """ConfigError unless `value` is at least `minimum` (`allowed` says it in words)."""
    if value is None or value < minimum:
        raise ConfigError(key, value, allowed or f"a number >= {minimum}")


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
    """OmegaConf's schema errors (unknown key, wrong type) as one ConfigError.

    `exc.full_key` names the key and `exc.object_type` the schema dataclass; the allowed keys or the
    field's type come from that dataclass. `values` (the merged container) supplies the bad value.
    """
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
