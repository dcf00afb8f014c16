"""Where a study lives: the `hydra.sweeper.storage` value turned into an Optuna storage.

- null: a SQLite file `<output_dir>/gpuopt.db` (one machine).
- `memory`: in-memory, nothing kept.
- `journal:///abs/path/study.log` (or `journal://relative/path.log`): Optuna's JournalStorage on a
  JournalFileBackend, for several workers on one host or on a shared file system (NFS), no server.
- any SQLAlchemy URL (`postgresql+psycopg://user@host/db`, `mysql+pymysql://...`, `sqlite:///...`):
  Optuna's RDBStorage.

Every storage is opened with heartbeats (`hydra.sweeper.heartbeat_interval` seconds, failed after
`hydra.sweeper.grace_period`): a worker that dies mid-trial stops beating, and the next worker to
ask for a trial fails that trial and re-queues its params. RDBStorage has this built in; Optuna 5's
JournalStorage has no heartbeat, so `HeartbeatJournalStorage` adds Optuna's own `BaseHeartbeat`
interface to it, beating through a trial system attr (its clock is the workers' wall clocks:
keep hosts NTP-synced).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from gpuopt.core._compat import StaleTrialsByPublicName, heartbeat_base, heartbeat_enabled, trial_id
from gpuopt.core.secrets import mask_secrets
from gpuopt.study.rules import HEARTBEAT_ATTR

JOURNAL_SCHEME = "journal://"


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
            self.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, time.time())

    def stale_trial_ids(self, study_id: int) -> list[int]:
        assert self.heartbeat_interval is not None
        grace = self.grace_period or 2 * self.heartbeat_interval
        now = time.time()
        stale = []
        for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
            # Never beat: resume.OwnerlessWatch times it (as for RDBStorage, which skips it too).
            last = t.system_attrs.get(HEARTBEAT_ATTR)
            if last is not None and now - last > grace:
                stale.append(trial_id(t))
        return stale

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
    if heartbeat_interval is not None and heartbeat_interval <= 0:
        heartbeat_interval = None
    if text.startswith(JOURNAL_SCHEME):
        path = journal_path(text)
        path.parent.mkdir(parents=True, exist_ok=True)
        return HeartbeatJournalStorage(
            JournalFileBackend(str(path)), heartbeat_interval, grace_period
        )
    kwargs: dict[str, Any] = {}
    if not text.startswith("sqlite"):
        # A server closes idle connections; a worker busy with a long trial must not trip on one.
        kwargs["engine_kwargs"] = {"pool_pre_ping": True}
    for attempt in range(3):
        try:
            with _quiet_experimental():
                return RDBStorage(
                    text,
                    heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period if heartbeat_interval else None,
                    **kwargs,
                )
        except Exception as exc:
            racing = ("already exists", "duplicate", "unique constraint", "database is locked")
            if attempt == 2 or not any(r in str(exc).lower() for r in racing):
                raise RuntimeError(
                    f"cannot open storage {display(text)}: {mask_secrets(str(exc).splitlines()[0])}"
                ) from None
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


def heartbeat_on(storage: Any) -> bool:
    return heartbeat_enabled(storage)


def display(spec: Any) -> str:
    """The storage as logs, attrs, summaries and exported files may show it (password masked)."""
    return mask_secrets(str(spec)) if spec is not None else "memory"


class _quiet_experimental:
    """heartbeat_interval is an experimental RDBStorage argument: no warning per sweep."""

    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
