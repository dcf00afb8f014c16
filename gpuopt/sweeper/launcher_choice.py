"""Which launcher runs the trials of an app that gpuopt measures.

Settings measured in one long-lived process read 10-35% faster than in fresh ones (warm caches,
allocator), so with Hydra's `basic` launcher later trials look faster than the baseline. When
gpuopt measures the app and the app left Hydra's default launcher in place, the sweep uses
`hydra/launcher=fresh_process` (one log line says so); an app that chose a launcher keeps it."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from gpuopt.core._compat import launcher_chosen
from gpuopt.sweeper.options import SweeperOptions

log = logging.getLogger("gpuopt.sweeper")

FRESH = "fresh_process"  # the ConfigStore name (gpuopt.sweeper.launchers.fresh_process)


def wants_fresh_process(options: SweeperOptions, config_loader: Any, config: DictConfig) -> bool:
    """Whether to replace Hydra's default launcher by gpuopt's fresh-process one."""
    if not options.measured:
        return False
    choices = config.hydra.runtime.choices or {}
    if choices.get("hydra/launcher") != "basic":
        return False  # the app picked another launcher
    try:
        return not launcher_chosen(config_loader, config)
    except Exception as exc:  # a Hydra whose defaults list reads differently: keep the app's
        log.warning("launcher: keeping hydra/launcher=basic (could not tell who chose it: %s)", exc)
        return False


def use_fresh_process(config: DictConfig) -> None:
    """Make the sweep's master config select gpuopt's fresh-process launcher, as
    `hydra/launcher=fresh_process` on the command line would (every trial's config is composed with it)."""
    from gpuopt.sweeper.launchers.fresh_process import FreshProcessConf

    hydra = config.hydra
    with contextlib.ExitStack() as stack:
        # Hydra marks its nodes read-only one by one: each is opened where it is written.
        for node in (hydra, hydra.runtime.choices, hydra.overrides.hydra):
            stack.enter_context(read_write(node))
        stack.enter_context(open_dict(hydra))
        hydra.launcher = OmegaConf.structured(FreshProcessConf)
        hydra.runtime.choices["hydra/launcher"] = FRESH
        hydra.overrides.hydra.append(f"hydra/launcher={FRESH}")
    log.info(
        "trials run in fresh processes (hydra/launcher=%s): gpuopt measures this app's objectives, "
        "and in one long-lived process later trials read faster; hydra/launcher=basic keeps them "
        "in this process",
        FRESH,
    )
