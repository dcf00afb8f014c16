"""Files that belong to a trial, kept where Optuna keeps them: its artifact store.

Each trial's `result.json` (and a profiled trial's `trace.json.gz`) is uploaded before the trial
is told (a finished trial's attributes are read-only), so optuna-dashboard lists them.
`hydra.sweeper.artifacts`: `auto` (`artifacts/` beside the study's file), a directory, or null.
No store or a failed upload is a warning: the sweep goes on. Torch-free."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.artifacts import FileSystemArtifactStore, upload_artifact

from gpuopt.core.result import TrialResult
from gpuopt.core.secrets import mask_secrets
from gpuopt.study import storage as storage_mod
from gpuopt.study.keys import (
    ATTR_ARTIFACTS,
    ATTR_PROFILE,
    STUDY_ARTIFACT_STORE,
    STUDY_BEST_PROFILE,
)
from gpuopt.sweeper import record
from gpuopt.sweeper.record import run_dir

log = logging.getLogger("gpuopt.sweeper")

AUTO = "auto"  # hydra.sweeper.artifacts: beside the study's file
STORE_DIR = "artifacts"
RESULT_FILE = "result.json"  # what gpuopt.run writes into a trial's run directory


def store_dir(option: str | None, storage_url: str | None) -> Path | None:
    """Where the trial files go: the option's directory, else (auto) `artifacts/` beside the
    study's SQLite or journal file; None when off or when the study has no file."""
    if option is None:
        return None
    if option != AUTO:
        return Path(option).expanduser().resolve()
    if not isinstance(storage_url, str):
        return None
    if storage_url.startswith(storage_mod.JOURNAL_SCHEME):
        study_file: Path | None = storage_mod.journal_path(storage_url)
    else:
        study_file = storage_mod.sqlite_path(storage_url)
    return None if study_file is None else study_file.resolve().parent / STORE_DIR


@dataclass
class TrialFiles:
    """The sweep's artifact store, and the uploads of each trial's files into it."""

    path: Path
    store: FileSystemArtifactStore

    @classmethod
    def for_study(
        cls, option: str | None, storage_url: str | None, study: optuna.Study
    ) -> TrialFiles | None:
        """The store for this sweep (created, and recorded on the study), or None (a warning
        where files could have been kept but no store can be)."""
        path = store_dir(option, storage_url)
        if path is None:
            if option is not None:
                log.warning(
                    "trial files (result.json, trace.json.gz) are not kept in Optuna's artifact "
                    "store: the study has no file to keep them beside (give "
                    "hydra.sweeper.artifacts=<directory>, or null to silence this)"
                )
            return None
        try:
            path.mkdir(parents=True, exist_ok=True)
            if study.user_attrs.get(STUDY_ARTIFACT_STORE) != str(path):
                record.study_attrs(study, {STUDY_ARTIFACT_STORE: str(path)})
        except Exception as exc:  # an unwritable directory: the sweep goes on without files
            log.warning("no artifact store at %s (%s: %s)", path, type(exc).__name__, exc)
            return None
        log.info(
            "trial files in Optuna's artifact store %s (optuna-dashboard --artifact-dir)", path
        )
        return cls(path, FileSystemArtifactStore(path))

    def upload_trial(self, study: optuna.Study, trial: Any, ret: Any, outcome: Any) -> None:
        """Upload the trial's result.json and trace.json.gz; their artifact ids go into
        `outcome.user_attrs[ATTR_ARTIFACTS]` ({file name: id}). Never raises."""
        uploaded: dict[str, str] = {}
        with tempfile.TemporaryDirectory(prefix="gpuopt-artifacts-") as scratch:
            for path in trial_files(ret, outcome, Path(scratch)):
                try:
                    uploaded[path.name] = upload_artifact(
                        artifact_store=self.store, file_path=str(path), study_or_trial=trial
                    )
                except Exception as exc:
                    log.warning(
                        "trial #%d: %s not uploaded to the artifact store %s (%s: %s)",
                        trial.number, path.name, self.path, type(exc).__name__, exc,
                    )  # fmt: skip
        if uploaded:
            outcome.user_attrs[ATTR_ARTIFACTS] = uploaded

    def upload_best_trace(self, study: optuna.Study) -> None:
        """The best's profiled run (not a trial: profile_runs.py) keeps its trace as a study
        artifact, `trace-best-trial-N.json.gz` (a finished trial takes no artifact). Never raises."""
        best = study.user_attrs.get(STUDY_BEST_PROFILE)
        profile = best.get("profile") if isinstance(best, dict) else None
        trace = profile.get("trace_path") if isinstance(profile, dict) else None
        if not isinstance(trace, str) or not Path(trace).is_file():
            return
        name = f"trace-best-trial-{best.get('trial')}.json.gz"
        try:
            with tempfile.TemporaryDirectory(prefix="gpuopt-artifacts-") as scratch:
                copy = Path(scratch) / name
                shutil.copyfile(trace, copy)
                upload_artifact(
                    artifact_store=self.store, file_path=str(copy), study_or_trial=study
                )
        except Exception as exc:
            log.warning("%s not uploaded to the artifact store %s (%s)", name, self.path, exc)


def trial_files(ret: Any, outcome: Any, scratch: Path) -> list[Path]:
    """The files of one trial: its result.json as a masked copy in `scratch` (a stored file never
    holds a secret), and the profiled window's trace."""
    files = []
    written = _run_dir_result(ret)
    if written is not None:
        text: str | None = written.read_text()
    else:
        result = _returned_result(ret)
        text = (
            None if result is None else json.dumps(result.to_dict(), indent=2, default=str) + "\n"
        )
    if text is not None:
        files.append(scratch / RESULT_FILE)
        files[-1].write_text(mask_secrets(text))
    profile = outcome.user_attrs.get(ATTR_PROFILE)
    trace = profile.get("trace_path") if isinstance(profile, dict) else None
    if isinstance(trace, str) and Path(trace).is_file():
        files.append(Path(trace))
    return files


def _run_dir_result(ret: Any) -> Path | None:
    folder = run_dir(ret)
    path = Path(folder) / RESULT_FILE if folder else None
    return path if path is not None and path.is_file() else None


def _returned_result(ret: Any) -> TrialResult | None:
    """The TrialResult a task of its own returned (measure_step, MeasureCallback), if any."""
    try:
        value = ret.return_value  # raises the task's exception for a failed job
    except Exception:
        return None
    if isinstance(value, dict) and isinstance(value.get("metrics"), dict):
        try:  # a result read back as its dict (TrialResult.to_dict)
            return TrialResult.from_dict(value)
        except Exception:
            return None
    return value if isinstance(value, TrialResult) else None
