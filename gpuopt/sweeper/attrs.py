"""Write a trial's user attributes in one storage transaction.

A gpuopt trial carries ~30 user attrs (every metric flat, status, overrides, ...). Optuna's public
`set_trial_user_attr` commits once per key, which on SQLite costs a few ms each (tens of ms on a
busy disk): 30 commits per trial. For RDB storages this writes them all in one transaction through
the storage's own per-key helper; any other storage (or an Optuna whose internals moved) falls back
to the public call, key by key.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def set_user_attrs(storage: Any, trial_id: int, attrs: dict[str, Any]) -> None:
    backend = getattr(storage, "_backend", storage)  # optuna wraps RDBStorage in _CachedStorage
    try:
        from optuna.storages import RDBStorage
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        if isinstance(backend, RDBStorage):
            with _create_scoped_session(backend.scoped_session, True) as session:
                for key, value in attrs.items():
                    backend._set_trial_attr_without_commit(
                        session, models.TrialUserAttributeModel, trial_id, key, value
                    )
            return
    except (ImportError, AttributeError, TypeError) as exc:  # internals changed: the public way
        log.debug("bulk user attrs unavailable (%s); writing them one by one", exc)
    for key, value in attrs.items():
        storage.set_trial_user_attr(trial_id, key, value)
