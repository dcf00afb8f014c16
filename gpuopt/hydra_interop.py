"""gpuopt installed beside a Hydra app changes nothing in how the app runs.

Hydra loads every installed plugin's entry point (the `hydra.plugins` group) when any Hydra app
starts, before it composes or instantiates anything. This module is one such entry point: a
search-path plugin that adds nothing to the search path, whose import applies the adapters in
gpuopt.core._compat that keep an app written for Hydra 1.3 running as it did there under the
Hydra 1.4 that gpuopt installs (docs/your-training.md, "Installed beside your app"):

- `_partial_: true` factories pickle again (lightning-hydra-template keeps its optimizer and
  scheduler factories in Lightning's hparams and checkpoints);
- the execution-whitelist deprecation is said once per process, in one warning that says how
  to pass the app's whitelist, not in 7 lines for every `_target_`.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from gpuopt.core._compat import picklable_hydra_partials, whitelist_warning_once

try:
    picklable_hydra_partials()
    whitelist_warning_once()
except (ImportError, AttributeError):  # a Hydra without these internals (1.3, or a later 1.4)
    pass  # nothing to undo there; tests/test_hydra_interop.py pins them on the installed Hydra


class Hydra13Behaviour(SearchPathPlugin):
    """Registered so that Hydra imports this module at start-up; adds no search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        return None
