"""`hydra.sweeper.custom_search_space`: the app's function that adds params to each trial.

The stock sweeper instantiates it with no execution whitelist, which Hydra 1.4 warns about (an
error from 1.5). gpuopt trusts what the user already runs: the app's module and its package, plus
`trust` for gpuopt's own task; anything else is instantiated as the stock sweeper does."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate


def app_modules(task_function: Any) -> list[str]:
    """Whitelist patterns for the app's module and package. A script's task lives in `__main__`,
    which Hydra's `_locate` imports again under its file name; `python -m pkg.app` names it `pkg.app`."""
    name = getattr(task_function, "__module__", None) or ""
    if name == "__main__":
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        path = getattr(main, "__file__", None)
        name = spec.name if spec is not None and spec.name else (Path(path).stem if path else "")
    if not name or name == "__main__":
        return []
    patterns = [f"{name}.*"]
    if "." in name:
        patterns.append(f"{name.rsplit('.', 1)[0]}.*")
    return patterns


def trusted(target: str, patterns: Sequence[str]) -> bool:
    """Whether `target` is under one of the patterns (`mod.*` or an exact dotpath)."""
    return any(target.startswith(p[:-1]) if p.endswith(".*") else target == p for p in patterns)


def extender(
    target: str | None, task_function: Any, trust: Sequence[str] = ()
) -> Callable[[Any, Any], None] | None:
    """The custom_search_space function (a partial, called with the config and the trial)."""
    if not target:
        return None
    node = {"_target_": str(target), "_partial_": True}
    patterns = [*app_modules(task_function), *(str(p) for p in trust)]
    if trusted(str(target), patterns):
        return instantiate(node, _execution_whitelist_=patterns)
    return instantiate(node)  # the stock call: Hydra warns that nothing whitelists it
