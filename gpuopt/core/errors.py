"""The one error a bad configuration raises, in every process: key, bad value, what is allowed."""

from __future__ import annotations

from typing import Any


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
