"""`hydra.sweeper.custom_search_space`: the app's function that adds params to each trial.

The stock sweeper instantiates the dotpath with Hydra's `instantiate` and no execution whitelist,
which Hydra 1.4 warns about (an error from Hydra 1.5; hydra-optuna-sweeper's own test of its
custom-search-space example fails under `python -Werror` for it). A config naming a function is
a config running code, so gpuopt trusts what the user already runs: the app's own module (the
script, or the module `python -m` ran) and the package it is in, plus gpuopt's `trust` list for
gpuopt's own task. A dotpath outside them is instantiated as the stock sweeper does (Hydra's
warning included): never worse than the stock plugin.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.utils import instantiate


def app_modules(task_function: Any) -> list[str]:
    """Whitelist patterns for the app whose task function this is: its module and its package.

    A script's task lives in `__main__`; Hydra's `_locate` imports it again under its file name
    (the script's folder is sys.path[0]), and `python -m pkg.app` gives `__main__` the spec name
    `pkg.app`.
    """
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
