"""Which numbers the study optimizes, and how one trial's return value becomes Optuna values.

`oom`/`diverged` become worst-case values plus an Optuna constraint (so samplers learn the region
is infeasible), `error` a FAIL; a stock task's float(s) are used as hydra-optuna-sweeper does."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import ListConfig

from gpuopt.core.errors import SweepConfigError
from gpuopt.core.metrics import goals, on_device
from gpuopt.core.result import Metrics, Status, TrialResult, result_user_attrs

DEFAULT_OBJECTIVES = ("throughput_amortized", "utilization")
UTILIZATION = "utilization"  # NVML's util.gpu; where GPM is there, its stand-in (`on_device`)
DIRECTIONS = ("minimize", "maximize")
# Constraint keys set on every COMPLETE gpuopt trial: 1.0 when the trial hit it (infeasible), else 0.
# `numerics`: an ok trial whose numerics guard found the loss drifting from the fp32 reference
# (gpuopt.trial.numerics; the evidence is the trial's `numerics` user attr).
NUMERICS_CONSTRAINT = "numerics"
CONSTRAINT_KEYS = (Status.OOM.value, Status.DIVERGED.value, NUMERICS_CONSTRAINT)


def parse_directions(direction: Any) -> list[str] | None:
    """`hydra.sweeper.direction` (one or a list of minimize | maximize, or the stock plugin's
    Direction enum) as names; None when not given."""
    if direction is None:
        return None
    items = list(direction) if isinstance(direction, (list, tuple, ListConfig)) else [direction]
    if not items:
        raise SweepConfigError("hydra.sweeper.direction", [], "one direction per objective")
    names = [str(getattr(d, "name", d)).lower() for d in items]
    for item, name in zip(items, names, strict=True):
        if name not in DIRECTIONS:
            raise SweepConfigError(
                "hydra.sweeper.direction", item, "minimize | maximize, or a list of them"
            )
    return names


def resolve_objectives(
    objectives: Sequence[str] | None, direction: Any
) -> tuple[list[str], list[str]]:
    """(metric names, directions) from the sweeper config; raises SweepConfigError.
    objectives given: directions from each metric's goal unless `direction` is given (a name of the
    task's own needs it); only `direction`: the first default objectives; neither: the defaults."""
    directions = parse_directions(direction)
    if objectives is None:
        if directions is None:
            names = list(DEFAULT_OBJECTIVES)
            return names, [goals()[n] for n in names]
        if len(directions) > len(DEFAULT_OBJECTIVES):
            raise SweepConfigError(
                "hydra.sweeper.direction",
                directions,
                f"at most {len(DEFAULT_OBJECTIVES)} directions without hydra.sweeper.objectives "
                f"(defaults: {', '.join(DEFAULT_OBJECTIVES)}); name the metrics with "
                "hydra.sweeper.objectives=[...]",
            )
        return list(DEFAULT_OBJECTIVES[: len(directions)]), directions

    names = [str(n) for n in objectives]
    if not names:
        raise SweepConfigError(
            "hydra.sweeper.objectives", [], f"one or more of {', '.join(goals())}"
        )
    unknown = [n for n in names if n not in goals()]
    if unknown and (directions is None or len(directions) != len(names)):
        # A metric of the task's own (a returned dict's `val_acc`) has no known goal: say it.
        raise SweepConfigError(
            "hydra.sweeper.objectives",
            unknown[0],
            f"gpuopt's metric names ({', '.join(goals())}), or a metric your task returns "
            f"with hydra.sweeper.direction giving one direction per objective ({len(names)})",
        )
    if len(set(names)) != len(names):
        raise SweepConfigError("hydra.sweeper.objectives", names, "each metric at most once")
    if directions is None:
        return names, [goals()[n] for n in names]
    if len(directions) != len(names):
        raise SweepConfigError(
            "hydra.sweeper.direction",
            directions,
            f"{len(names)} direction(s), one per objective {names} (or leave direction unset: "
            "it follows each metric's goal)",
        )
    return names, directions


def on_this_device(names: Sequence[str], facts: Mapping[str, Any] | None) -> list[str]:
    """The default objectives on the probed device: `utilization` is `sm_active` where the GPU
    has GPM (util.gpu says only that a kernel ran). Objectives a user names stay."""
    return [on_device(name, facts or {}) for name in names]


def utilization_note(names: Sequence[str], facts: Mapping[str, Any] | None) -> str | None:
    """One line: which utilization a sweep on an NVIDIA GPU optimizes and why; None when
    neither is an objective, or off NVIDIA (`facts`: the env probe's)."""
    facts = facts or {}
    stand_in = on_device(UTILIZATION, {**facts, "gpm": True})
    if stand_in in names:
        return (
            f"utilization objective: {stand_in} (GPM: the share of SMs busy); {UTILIZATION} "
            "(NVML util.gpu: a kernel was running) recorded beside it as evidence"
        )
    if UTILIZATION not in names or facts.get("device") != "cuda":
        return None  # off NVIDIA, utilization is 100 - data_wait: the metric table says so
    why = facts.get("gpm_why") or "the env probe did not say whether GPM is there"
    return (
        f"utilization objective: {UTILIZATION} (NVML util.gpu: a kernel was running), not "
        f"{stand_in}: {why}"
    )


def worst_value(direction: str) -> float:
    """The value an infeasible trial is told: 0 for a maximized metric (all are >= 0), +inf for a
    minimized one (GPSampler clips it to the worst finite value when fitting)."""
    return 0.0 if direction == "maximize" else math.inf


@dataclass
class TrialOutcome:
    """What the sweeper tells Optuna about one finished trial."""

    status: str  # ok | oom | diverged | error
    values: list[float] | None  # None for FAIL
    constraints: dict[str, float] = field(default_factory=dict)  # empty for stock-style tasks
    user_attrs: dict[str, Any] = field(default_factory=dict)
    plain: bool = False  # the task returned a plain float/list (stock style), not a TrialResult

    @property
    def failed(self) -> bool:
        return self.status == Status.ERROR.value

    @property
    def feasible(self) -> bool:
        return self.status == Status.OK.value


def error_outcome(reason: str) -> TrialOutcome:
    return TrialOutcome(
        status=Status.ERROR.value, values=None, user_attrs={"status": "error", "reason": reason}
    )


def outcome_from_return(
    value: Any, objectives: Sequence[str], directions: Sequence[str]
) -> TrialOutcome:
    """Turn a task's return value into values, constraints and user attrs (never raises)."""
    if isinstance(value, dict) and "status" in value and "metrics" in value:
        try:
            value = TrialResult.from_dict(value)
        except Exception as exc:  # a malformed dict: an error trial, not a crash of the sweep
            return error_outcome(f"unreadable trial result: {type(exc).__name__}: {exc}")
    if isinstance(value, dict) and not isinstance(value.get("metrics"), dict):
        return _outcome_from_named(value, objectives, directions)
    if isinstance(value, TrialResult):
        return _outcome_from_result(value, objectives, directions)
    return _outcome_from_plain(value, directions)


def _outcome_from_named(
    named: dict[str, Any], objectives: Sequence[str], directions: Sequence[str]
) -> TrialOutcome:
    """A dict of named metrics (`{"throughput": ..., "val_loss": ...}`, optionally "status" and
    "reason"): gpuopt's metric names fill a TrialResult; every other scalar is a user attribute."""
    known = {f.name for f in dataclasses.fields(Metrics)}
    try:
        status = Status(named.get("status", Status.OK.value))
    except ValueError:
        return error_outcome(f"unknown status in the returned metrics: {named.get('status')!r}")
    metrics = Metrics(**{k: v for k, v in named.items() if k in known})
    result = TrialResult(status=status, metrics=metrics, reason=named.get("reason"))
    extras = {k: v for k, v in named.items() if k not in known and k not in ("status", "reason")}
    scalars = {k: v for k, v in extras.items() if isinstance(v, (int, float, str, bool))}
    outcome = _outcome_from_result(result, objectives, directions, own=scalars)
    outcome.user_attrs.update(scalars)
    return outcome


def _outcome_from_result(
    result: TrialResult,
    objectives: Sequence[str],
    directions: Sequence[str],
    own: dict[str, Any] | None = None,
) -> TrialOutcome:
    """`own`: the task's own named metrics (a returned dict's `val_acc`), objectives too."""
    attrs = result_user_attrs(result)
    status = result.status.value
    if result.status is Status.ERROR:
        return TrialOutcome(status=status, values=None, user_attrs=attrs)
    if result.status is Status.OK:
        values: list[float] = []
        for name in objectives:
            metric = result.metric(name) if name in goals() else _own_metric(own, name)
            if metric is None:
                attrs["status"] = Status.ERROR.value
                attrs["reason"] = (
                    f"objective {name!r} was not measured in this trial (None): it is not measurable "
                    f"on this device; choose other hydra.sweeper.objectives"
                    if name in goals()
                    else f"objective {name!r} is not a number in the metrics the task returned"
                )
                return TrialOutcome(status=Status.ERROR.value, values=None, user_attrs=attrs)
            values.append(float(metric))
        constraints = {k: 0.0 for k in CONSTRAINT_KEYS}
        if result.numerics is not None and result.numerics.get("passed") is False:
            constraints[NUMERICS_CONSTRAINT] = 1.0  # measured, but not the same training
        return TrialOutcome(status=status, values=values, constraints=constraints, user_attrs=attrs)
    # oom / diverged: a region of the space that does not work, told as data.
    constraints = {k: (1.0 if k == status else 0.0) for k in CONSTRAINT_KEYS}
    return TrialOutcome(
        status=status,
        values=[worst_value(d) for d in directions],
        constraints=constraints,
        user_attrs=attrs,
    )


def _own_metric(own: dict[str, Any] | None, name: str) -> float | None:
    """A task's own metric as a number; None when it is missing, not a number, or NaN."""
    value = (own or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _outcome_from_plain(value: Any, directions: Sequence[str]) -> TrialOutcome:
    """Stock hydra-optuna-sweeper semantics: a float for one direction, a list for several."""
    try:
        values = [float(value)] if len(directions) == 1 else [float(v) for v in value]
    except (TypeError, ValueError):
        kind = "a float" if len(directions) == 1 else "a list or tuple of floats"
        hint = (
            ": list gpuopt.MeasureCallback in the app's Lightning callbacks config, or return "
            "gpuopt's result (docs/your-training.md)"
            if value is None
            else ""
        )
        return error_outcome(f"return value must be a TrialResult or {kind}; got {value!r}{hint}")
    if len(values) != len(directions):
        return error_outcome(
            f"the task returned {len(values)} values for {len(directions)} objectives: {values}"
        )
    if any(math.isnan(v) for v in values):
        return error_outcome(f"the task returned NaN: {values}")
    return TrialOutcome(
        status=Status.OK.value, values=values, user_attrs={"status": "ok"}, plain=True
    )
