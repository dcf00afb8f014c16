"""gpuopt installed beside a Hydra app changes nothing in how the app runs.

Hydra imports every installed `hydra.plugins` entry point when any Hydra app starts. This module is
one (a search-path plugin that adds nothing): its import applies gpuopt.core._compat's adapters
that keep an app written for Hydra 1.3 running as it did under the Hydra 1.4 gpuopt installs:
`_partial_: true` factories pickle again (lightning-hydra-template keeps them in checkpoints), and
the execution-whitelist deprecation is one warning per process, not 7 lines for every `_target_`.
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
