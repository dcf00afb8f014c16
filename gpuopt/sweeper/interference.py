"""Several workers measuring on one host compete for cores, memory bandwidth and GPUs: every
throughput they report is wrong (a baseline read 87 samples/s under three workers against ~6,000
alone). A trial that overlapped in time with another worker's on the same host is flagged (user
attr, warning, summary note). One worker's own batch (n_jobs > 1) is not: its jobs get separate GPUs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from optuna.trial import TrialState

from gpuopt.study.keys import ATTR_INTERFERENCE, ATTR_OWNER
from gpuopt.sweeper.resume import frozen_of, owner_alive


def _interval(trial: Any, now: dt.datetime) -> tuple[dt.datetime, dt.datetime] | None:
    if trial.datetime_start is None or trial.state == TrialState.WAITING:
        return None
    end = trial.datetime_complete or (now if trial.state == TrialState.RUNNING else None)
    return (trial.datetime_start, end) if end is not None else None


def overlapping(trial: Any, trials: Sequence[Any], now: dt.datetime) -> list[int]:
    """Numbers of the trials of other workers on `trial`'s host whose run overlapped with it
    (`trial` is still running: it ends `now`)."""
    owner = trial.system_attrs.get(ATTR_OWNER) or {}
    span = _interval(trial, now)
    if not owner.get("host") or span is None:
        return []
    found = []
    for other in trials:
        other_owner = other.system_attrs.get(ATTR_OWNER) or {}
        if (
            other.number == trial.number
            or other_owner.get("host") != owner["host"]
            or other_owner.get("pid") == owner.get("pid")
        ):
            continue
        if other.state == TrialState.RUNNING and owner_alive(other_owner) is False:
            continue  # a dead sweep's trial, not yet recovered: it does not run now
        other_span = _interval(other, now)
        if other_span is not None and other_span[0] < span[1] and span[0] < other_span[1]:
            found.append(other.number)
    return found


def flag(trial: Any, trials: Sequence[Any]) -> dict[str, Any] | None:
    """The `interference` attr of a trial about to be recorded, or None when it ran alone."""
    now = dt.datetime.now()  # Optuna's datetimes are naive local time of the worker's host
    others = overlapping(trial, trials, now)
    if not others:
        return None
    host = (trial.system_attrs.get(ATTR_OWNER) or {}).get("host")
    return {"host": host, "trials": others}


def warning_text(attr: dict[str, Any]) -> str:
    return (
        f"measured while other workers ran trials on host {attr['host']} (trials "
        f"{', '.join(f'#{n}' for n in attr['trials'])}): they share its cores and devices, so "
        "this measurement (and any speedup from it) is not comparable; run one worker per host"
    )


def summary_note(trials: Sequence[Any]) -> str | None:
    """The summary's line when any trial of the study was flagged."""
    flagged = [t for t in trials if t.user_attrs.get(ATTR_INTERFERENCE)]
    if not flagged:
        return None
    hosts = sorted({str(t.user_attrs[ATTR_INTERFERENCE].get("host")) for t in flagged})
    return (
        f"INTERFERENCE: {len(flagged)} trial(s) ran at the same time as other workers' trials on "
        f"host {', '.join(hosts)}: their measurements interfere, speedups are not reliable; run "
        "one worker per host (or hydra.sweeper.n_jobs on one worker, one GPU per trial)"
    )


def flag_outcome(study: Any, trial: Any, outcome: Any, trials: Sequence[Any] | None = None) -> None:
    """Other workers' trials ran on this host at the same time as `trial`: say so in the outcome
    and the log. `trials`: the study's trials read after the run (None: read here)."""
    import logging

    from gpuopt.study.keys import ATTR_WARNINGS

    if trials is None:
        trials = study.get_trials(deepcopy=False)
    frozen = frozen_of(trials, trial.number)
    attr = flag(frozen, trials) if frozen is not None else None
    if attr is None:
        return
    text = warning_text(attr)
    outcome.user_attrs[ATTR_INTERFERENCE] = attr
    outcome.user_attrs[ATTR_WARNINGS] = [*(outcome.user_attrs.get(ATTR_WARNINGS) or []), text]
    logging.getLogger("gpuopt.sweeper").warning("trial #%d %s", trial.number, text)
