"""A study's artifact store, as its sweep recorded it: where the report keeps its page.

The sweeper keeps each trial's files in Optuna's artifact store (gpuopt/sweeper/trial_artifacts.py) and
records the store's directory in the study user attr `artifact_store`; `store_page` puts the
report page there too, as a study artifact (optuna-dashboard lists it on the study;
`optuna.artifacts.download_artifact` gets it back). A study without a store, or a store this
machine cannot reach, keeps its page only where it was written.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import optuna
from optuna.artifacts import FileSystemArtifactStore, get_all_artifact_meta, upload_artifact

from gpuopt.study.keys import STUDY_ARTIFACT_STORE


def study_store(study: optuna.Study) -> FileSystemArtifactStore | None:
    """The study's FileSystemArtifactStore, when its sweep recorded one this machine sees."""
    folder = study.user_attrs.get(STUDY_ARTIFACT_STORE)
    if not isinstance(folder, str) or not Path(folder).is_dir():
        return None
    return FileSystemArtifactStore(folder)


def store_page(study: optuna.Study, page: str | Path) -> str | None:
    """Upload the report page as a study artifact (once per distinct page: the same bytes are
    not stored twice); a note for the user, None without a store."""
    store = study_store(study)
    if store is None:
        return None
    path = Path(page)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    for meta in get_all_artifact_meta(study):
        if meta.filename == path.name and _digest(store, meta.artifact_id) == digest:
            return f"already in the study's artifact store as {meta.artifact_id}"
    try:
        artifact_id = upload_artifact(
            artifact_store=store, file_path=str(path), study_or_trial=study
        )
    except Exception as exc:  # the page is written; keeping a copy is a bonus
        return f"not stored in the study's artifact store: {type(exc).__name__}: {exc}"
    return f"stored in the study's artifact store as {artifact_id}"


def _digest(store: FileSystemArtifactStore, artifact_id: str) -> str | None:
    try:
        with store.open_reader(artifact_id) as reader:
            return hashlib.sha256(reader.read()).hexdigest()
    except Exception:  # removed from the store: not the same page
        return None
