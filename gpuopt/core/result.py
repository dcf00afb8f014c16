"""What one trial produced: the contract between the trial engine and everything that reads it
(the sweeper's values, constraints and user attributes; the report). Its metric names are the
public output contract.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from gpuopt.core.metrics import Metrics, goals


class Status(str, Enum):
    """How a trial ended. Only `error` counts as a failure of the sweep's machinery."""

    OK = "ok"
    OOM = "oom"  # ran out of device (or host) memory: an infeasible configuration
    DIVERGED = "diverged"  # loss became NaN/inf: an infeasible configuration
    ERROR = "error"  # anything else: a bug, a crash, a bad user model


@dataclass
class TrialResult:
    """One trial: its status, its metrics, and the facts needed to compare it with others."""

    status: Status
    metrics: Metrics = field(default_factory=Metrics)
    reason: str | None = None  # for oom/diverged/error: exception type and message
    config: dict[str, Any] = field(default_factory=dict)  # the resolved trial config
    env: dict[str, Any] = field(default_factory=dict)  # the fingerprint (gpuopt.trial.devices)
    warnings: list[str] = field(default_factory=list)  # settings that could not apply, etc.
    # The profiled window's summary (ProfileSummary.to_dict()); None: not profiled.
    profile: dict[str, Any] | None = None
    # The numerics guard's evidence (gpuopt.trial.numerics.GuardEvidence as a dict); None: not run.
    numerics: dict[str, Any] | None = None
    # A distributed trial's ranks, one row each (rank, status and the metrics whose record says
    # rank_row, gpuopt.core.metrics); None for a single-process trial.
    ranks: list[dict[str, Any]] | None = None
    # The trial's phase clock: seconds per phase (build, ..., other), summing to its wall time. Not
    # a metric; None where nothing was clocked.
    phases: dict[str, float] | None = None
    # What the app's own task returned beside a measuring callback's result (user attrs `app.*`).
    app_return: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def metric(self, name: str) -> float | None:
        if name not in goals() and not hasattr(self.metrics, name):
            raise KeyError(f"unknown metric {name!r}; known: {', '.join(sorted(goals()))}")
        value = getattr(self.metrics, name)
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else value

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        known = {f.name for f in dataclasses.fields(Metrics)}
        metrics = Metrics(**{k: v for k, v in (data.get("metrics") or {}).items() if k in known})
        kinds = {"profile": dict, "ranks": list, "phases": dict, "app_return": dict}
        return cls(
            status=Status(data["status"]),
            metrics=metrics,
            reason=data.get("reason"),
            config=data.get("config") or {},
            env=data.get("env") or {},
            warnings=list(data.get("warnings") or []),
            numerics=data.get("numerics"),
            **{k: v if isinstance(v := data.get(k), kind) else None for k, kind in kinds.items()},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TrialResult:
        return cls.from_dict(json.loads(Path(path).read_text()))


# The trial user attrs a result is stored under (`result_user_attrs`), besides every metric flat
# under its own name; readers take them from gpuopt.study.keys.
ATTR_STATUS = "status"
ATTR_REASON = "reason"
ATTR_ENV = "env"
ATTR_CONFIG = "config"  # the resolved trial config
ATTR_WARNINGS = "warnings"
ATTR_PROFILE = "profile"  # the profiled window's summary (dict), on profiled trials only
ATTR_NUMERICS = "numerics"  # the numerics guard's evidence (dict), absent when it did not run
ATTR_RANKS = "ranks"  # a distributed trial's per-rank rows (list), absent for one process
ATTR_PHASES = "phases"  # the trial's phase clock (dict: phase -> seconds), absent when not clocked
ATTR_APP_PREFIX = "app."  # the app's own returned metrics beside a callback's result (app.value)


def result_user_attrs(result: TrialResult) -> dict[str, Any]:
    """The user attributes a trial's result is stored under (all JSON-serializable)."""
    attrs: dict[str, Any] = {k: v for k, v in dataclasses.asdict(result.metrics).items()}
    attrs[ATTR_STATUS] = result.status.value
    for key in (ATTR_REASON, ATTR_ENV, ATTR_CONFIG, ATTR_WARNINGS):  # each its field's name
        attrs[key] = getattr(result, key)
    for key in (ATTR_PROFILE, ATTR_NUMERICS, ATTR_RANKS, ATTR_PHASES):
        if getattr(result, key) is not None:
            attrs[key] = getattr(result, key)
    for name, value in (result.app_return or {}).items():
        attrs[f"{ATTR_APP_PREFIX}{name}"] = value
    return json.loads(json.dumps(attrs, default=str))
