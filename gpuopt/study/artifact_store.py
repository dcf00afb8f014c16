"""Where the report keeps its page: the study's artifact store, as its sweep recorded it
(`artifact_store`), so optuna-dashboard lists the page on the study. No store, or one this machine
cannot reach: the page stays only where it was written.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import optuna
from optuna.artifacts import FileSystemArtifactStore, get_all_artifact_meta, upload_artifact

from gpuopt.study.keys import STUDY_ARTIFACT_STORE


def store_page(study: optuna.Study, page: str | Path) -> str | None:
    """Upload the report page as a study artifact, once per distinct content; a note for the user,
    None without a store."""
    folder = study.user_attrs.get(STUDY_ARTIFACT_STORE)
    if not isinstance(folder, str) or not Path(folder).is_dir():
        return None
    store = FileSystemArtifactStore(folder)
    path = Path(page)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    for meta in get_all_artifact_meta(study):
        if meta.filename != path.name:
            continue
        # an artifact removed from the store is not the same page
        with contextlib.suppress(Exception), store.open_reader(meta.artifact_id) as reader:
            if hashlib.sha256(reader.read()).hexdigest() == digest:
                return f"already in the study's artifact store as {meta.artifact_id}"
    try:
        artifact_id = upload_artifact(
            artifact_store=store, file_path=str(path), study_or_trial=study
        )
    except Exception as exc:  # the page is written; keeping a copy is a bonus
        return f"not stored in the study's artifact store: {type(exc).__name__}: {exc}"
    return f"stored in the study's artifact store as {artifact_id}"
