"""Write a trial's user attributes in one storage transaction.

A gpuopt trial carries ~30 user attrs (every metric flat, status, overrides, ...). Optuna's public
`set_trial_user_attr` commits once per key, which on SQLite costs a few ms each (tens of ms on a
busy disk): 30 commits per trial. For RDB storages this writes them all in one transaction through
the storage's own per-key helper (`_compat.set_user_attrs_in_one_transaction`); any other storage
(or an Optuna whose internals moved) falls back to the public call, key by key.
"""

from __future__ import annotations

import logging
from typing import Any

from gpuopt.core._compat import set_user_attrs_in_one_transaction

log = logging.getLogger(__name__)


def set_user_attrs(storage: Any, trial_id: int, attrs: dict[str, Any]) -> None:
    try:
        if set_user_attrs_in_one_transaction(storage, trial_id, attrs):
            return
    except (ImportError, AttributeError, TypeError) as exc:  # internals changed: the public way
        log.debug("bulk user attrs unavailable (%s); writing them one by one", exc)
    for key, value in attrs.items():
        storage.set_trial_user_attr(trial_id, key, value)
