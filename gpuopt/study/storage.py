"""Where a study lives: a `hydra.sweeper.storage` value turned into an Optuna storage, and the
studies an existing storage holds (the sweeper opens or creates one; the report only reads).

The value: null or `memory` (in-memory, the stock sweeper's meaning), `journal://path` (Optuna's
JournalStorage on a file: several workers, no server) or any SQLAlchemy URL (RDBStorage). Optuna
5's JournalStorage has no heartbeat, so `HeartbeatJournalStorage` adds Optuna's `BaseHeartbeat`
to it, beating through a trial system attr (the workers' wall clocks: keep hosts NTP-synced).
`open_existing` checks a SQLite file first: Optuna creates a missing one on connect, so a typo in
a path would "succeed" with an empty database.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from gpuopt.core._compat import StaleTrialsByPublicName, heartbeat_base, heartbeat_enabled, trial_id
from gpuopt.core.secrets import mask_secrets
from gpuopt.study.keys import ATTR_HEARTBEAT

JOURNAL_SCHEME = "journal://"
OUTPUT_DIR_ENV = "GPUOPT_OUTPUT_DIR"  # gpuopt's output_dir (conf/config.yaml), else ./outputs


class StorageError(Exception):
    """A storage or study that is not there (wrong path, unknown study): a message to act on."""


class StorageUnreachable(StorageError):
    """A server that could not be reached or refused the login: the reason in its words, masked."""

    def __init__(self, spec: str, exc: BaseException) -> None:
        # What the server said, without the driver's wrapping (psycopg's `connection failed: ...
        # failed: FATAL:  `, SQLAlchemy's `(Background on this error ...)` line).
        orig = getattr(exc, "orig", None) or exc
        text = str(orig).strip()
        line = text.splitlines()[0] if text else type(orig).__name__
        reason = re.sub(r"^(FATAL|ERROR):\s+", "", line.rsplit(" failed: ", 1)[-1].strip())
        reason = mask_secrets(reason[:1].lower() + reason[1:])
        super().__init__(f"cannot connect to {display(spec)}: {reason}")


class HeartbeatJournalStorage(StaleTrialsByPublicName, JournalStorage, heartbeat_base()):  # type: ignore[misc]
    """JournalStorage + Optuna's heartbeat interface (beats are trial system attrs in the log)."""

    def __init__(
        self, backend: Any, heartbeat_interval: int | None = None, grace_period: int | None = None
    ) -> None:
        super().__init__(backend)
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period

    def record_heartbeat(self, trial_id: int) -> None:
        # the trial may have finished between two beats
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError, KeyError):
            self.set_trial_system_attr(trial_id, ATTR_HEARTBEAT, time.time())

    def stale_trial_ids(self, study_id: int) -> list[int]:
        assert self.heartbeat_interval is not None
        grace = self.grace_period or 2 * self.heartbeat_interval
        now, running = time.time(), (TrialState.RUNNING,)
        # Never beat: resume.Recovery times it (as for RDBStorage, which skips it too).
        return [
            trial_id(t)
            for t in self.get_all_trials(study_id, deepcopy=False, states=running)
            if (last := t.system_attrs.get(ATTR_HEARTBEAT)) is not None and now - last > grace
        ]

    def get_heartbeat_interval(self) -> int | None:
        return self.heartbeat_interval

    def get_heartbeat_stale_trial_callback(self) -> None:
        return None  # gpuopt records the reason and re-queues itself (resume.fail_stale)


def journal_path(spec: str) -> Path:
    """`journal:///abs/x.log` -> /abs/x.log; `journal://rel/x.log` -> rel/x.log (from the cwd)."""
    rest = spec[len(JOURNAL_SCHEME) :]
    if not rest or rest == "/":
        raise ValueError(f"a journal storage needs a file path: {mask_secrets(spec)}")
    return Path(rest).expanduser()


def open_storage(
    spec: str | None, heartbeat_interval: int | None, grace_period: int | None
) -> BaseStorage | None:
    """An Optuna storage for a `hydra.sweeper.storage` value (None: in-memory)."""
    if spec is None:
        return None
    text = str(spec)
    heartbeat_interval = heartbeat_interval or None  # 0: off (the options allow 0 or >= 1)
    if text.startswith(JOURNAL_SCHEME):
        path = journal_path(text)
        path.parent.mkdir(parents=True, exist_ok=True)
        return HeartbeatJournalStorage(
            JournalFileBackend(str(path)), heartbeat_interval, grace_period
        )
    # A server closes idle connections; a worker busy with a long trial must not trip on one.
    kwargs = {} if text.startswith("sqlite") else {"engine_kwargs": {"pool_pre_ping": True}}
    for attempt in range(3):
        try:
            with warnings.catch_warnings():  # heartbeat_interval is experimental: no warning
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(
                    text,
                    heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period if heartbeat_interval else None,
                    **kwargs,
                )
        except Exception as exc:
            racing = ("already exists", "duplicate", "unique constraint", "database is locked")
            if attempt == 2 or not any(r in str(exc).lower() for r in racing):
                raise _failure(text, exc, RuntimeError) from None
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


def _failure(spec: str, exc: BaseException, error: type[Exception], text: str = "") -> Exception:
    """A DBAPI error raised while connecting (the server or the network said no) as
    StorageUnreachable, in the server's words; else `error` naming the storage."""
    import sqlalchemy

    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return StorageUnreachable(spec, exc)
    if not text:
        text = f"cannot open storage {display(spec)}: {mask_secrets(str(exc).splitlines()[0])}"
    return error(text)


def ping(spec: str | None) -> None:
    """Connect once to a server storage and disconnect, creating nothing: a refused login is known
    before the sweep probes the machine, and no table is made for a sweep that may still stop on
    bad input. SQLite and journal files are not opened (opening creates them). StorageUnreachable
    when the server says no; ValueError (or ImportError: a missing driver) for a URL SQLAlchemy
    cannot use."""
    if spec is None or spec.startswith((JOURNAL_SCHEME, "sqlite")):
        return
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(spec)
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ValueError) as exc:
        raise _failure(spec, exc, ValueError) from None
    try:
        with engine.connect():
            pass
    except Exception as exc:
        raise _failure(spec, exc, ValueError) from None
    finally:
        engine.dispose()


heartbeat_on = heartbeat_enabled


def display(spec: Any) -> str:
    """The storage as logs, attrs, summaries and exported files may show it (password masked)."""
    return mask_secrets(str(spec)) if spec is not None else "memory"


# ---- reading an existing storage (the report) --------------------------------------------------
def default_url() -> str:
    """sqlite:///<GPUOPT_OUTPUT_DIR or outputs>/gpuopt.db: where gpuopt's own app keeps its studies
    (conf/config.yaml's `hydra.sweeper.storage`)."""
    output_dir = os.environ.get(OUTPUT_DIR_ENV) or "outputs"
    return f"sqlite:///{Path(output_dir) / 'gpuopt.db'}"


def sqlite_path(url: str) -> Path | None:
    """The database file of a sqlite URL, or None for other storages and in-memory SQLite."""
    if not url.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    return Path(database)


def open_existing(url: str) -> BaseStorage:
    """Open an existing storage; a missing SQLite or journal file is a `StorageError`, never a new
    one."""
    path = journal_path(url) if url.startswith(JOURNAL_SCHEME) else sqlite_path(url)
    if path is not None and not path.is_file():
        hint = (
            f" ({OUTPUT_DIR_ENV}={os.environ[OUTPUT_DIR_ENV]})"
            if os.environ.get(OUTPUT_DIR_ENV)
            else ""
        )
        raise StorageError(
            f"no study database at {path}{hint}. Run a sweep first (python -m gpuopt.run -m), "
            "or pass --storage sqlite:///PATH/TO/gpuopt.db"
        )
    try:
        if url.startswith(JOURNAL_SCHEME):
            return HeartbeatJournalStorage(JournalFileBackend(str(path)))
        return optuna.storages.get_storage(url)
    except Exception as exc:
        text = mask_secrets(f"cannot open storage {url}: {type(exc).__name__}: {exc}")
        raise _failure(url, exc, StorageError, text) from None


@dataclass(frozen=True)
class StudyEntry:
    name: str
    n_trials: int
    started: datetime | None
    directions: tuple[str, ...]


def list_studies(storage: BaseStorage) -> list[StudyEntry]:
    """All studies, in creation order (the last one is the latest)."""
    summaries = optuna.study.get_all_study_summaries(storage, include_best_trial=False)
    # Study ids grow with creation; the summaries do not expose theirs, the storage does.
    summaries.sort(key=lambda s: storage.get_study_id_from_name(s.study_name))
    return [
        StudyEntry(
            s.study_name, s.n_trials, s.datetime_start, tuple(d.name.lower() for d in s.directions)
        )
        for s in summaries
    ]


def load_study(storage: BaseStorage, url: str, name: str | None) -> optuna.Study:
    """The named study, or the latest one when `name` is None."""
    studies = list_studies(storage)
    if not studies:
        raise StorageError(f"no studies in {url}")
    if name is None:
        name = studies[-1].name
    elif name not in {s.name for s in studies}:
        known = ", ".join(s.name for s in studies)
        raise StorageError(f"no study named {name!r} in {url}; studies there: {known}")
    return optuna.load_study(study_name=name, storage=storage)


def in_memory_copy(study: Any, trials: Any) -> Any:
    """An in-memory study holding `trials`, for reading only (the report's plots and importances)."""
    copy = optuna.create_study(directions=study.directions)
    copy.add_trials(list(trials))
    return copy
