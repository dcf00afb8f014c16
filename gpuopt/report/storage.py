"""Find and open the study database without ever creating one by accident.

Optuna's RDB storage creates a missing SQLite file (and its tables) on connect, so a typo in a path
would "succeed" with an empty database; the report checks the file first and fails with a message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import optuna

from gpuopt.core.secrets import mask_secrets

OUTPUT_DIR_ENV = "GPUOPT_OUTPUT_DIR"
DEFAULT_DB_NAME = "gpuopt.db"


class ReportError(Exception):
    """A problem the user can fix (wrong path, unknown study): a message, not a traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def default_storage_url() -> str:
    """sqlite:///<GPUOPT_OUTPUT_DIR or ./outputs>/gpuopt.db: where the sweeper writes by default."""
    output_dir = os.environ.get(OUTPUT_DIR_ENV) or "outputs"
    return f"sqlite:///{Path(output_dir) / DEFAULT_DB_NAME}"


def sqlite_path(url: str) -> Path | None:
    """The database file of a sqlite URL, or None for other storages and in-memory SQLite."""
    if not url.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    return Path(database)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Open an existing storage; a missing SQLite or journal file is a `ReportError`, never a new
    one. Any `hydra.sweeper.storage` value works: SQLAlchemy URLs and `journal://` files."""
    from gpuopt.study.storage import JOURNAL_SCHEME, journal_path

    path = journal_path(url) if url.startswith(JOURNAL_SCHEME) else sqlite_path(url)
    if path is not None and not path.is_file():
        hint = (
            f" ({OUTPUT_DIR_ENV}={os.environ[OUTPUT_DIR_ENV]})"
            if os.environ.get(OUTPUT_DIR_ENV)
            else ""
        )
        raise ReportError(
            f"no study database at {path}{hint}. Run a sweep first (python -m gpuopt.run -m), "
            "or pass --storage sqlite:///PATH/TO/gpuopt.db"
        )
    try:
        if url.startswith(JOURNAL_SCHEME):
            from gpuopt.study.storage import open_storage as open_sweep_storage

            return open_sweep_storage(url, heartbeat_interval=None, grace_period=None)
        return optuna.storages.get_storage(url)
    except Exception as exc:
        raise ReportError(
            mask_secrets(f"cannot open storage {url}: {type(exc).__name__}: {exc}")
        ) from None


@dataclass(frozen=True)
class StudyEntry:
    name: str
    n_trials: int
    started: datetime | None
    directions: tuple[str, ...]


def list_studies(storage: optuna.storages.BaseStorage) -> list[StudyEntry]:
    """All studies, in creation order (the last one is the latest)."""
    summaries = optuna.study.get_all_study_summaries(storage, include_best_trial=False)
    entries = [
        StudyEntry(
            s.study_name,
            s.n_trials,
            s.datetime_start,
            tuple(d.name.lower() for d in s.directions),
        )
        for s in summaries
    ]
    # Study ids grow with creation; the summaries do not expose theirs, the storage does.
    order = {s.study_name: storage.get_study_id_from_name(s.study_name) for s in summaries}
    return sorted(entries, key=lambda e: order[e.name])


def load_study(storage: optuna.storages.BaseStorage, url: str, name: str | None) -> optuna.Study:
    """The named study, or the latest one when `name` is None."""
    studies = list_studies(storage)
    if not studies:
        raise ReportError(f"no studies in {url}")
    if name is None:
        name = studies[-1].name
    elif name not in {s.name for s in studies}:
        known = ", ".join(s.name for s in studies)
        raise ReportError(f"no study named {name!r} in {url}; studies there: {known}")
    return optuna.load_study(study_name=name, storage=storage)
