"""The gpuopt Hydra sweeper: hydra-optuna-sweeper's keys and samplers, gpuopt's sweep loop.

Hydra imports this module on every run (plugin discovery), so it stays light: no optuna, no torch.
Every key of the stock `hydra/sweeper=optuna` works unchanged; the keys below them are gpuopt's."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from dataclasses import field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from hydra_plugins.hydra_optuna_sweeper import config as _stock_config  # noqa: F401  (sampler nodes)
from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf, TPESamplerConfig
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import OmegaConf

from gpuopt.core.errors import ConfigError
from gpuopt.core.secrets import mask_secrets
from gpuopt.sweeper.options import ConfirmOptions, RaceOptions, SweeperOptions

# The sampler configs (tpe, random, grid, nsgaii, gp, cmaes, qmc, ...) are the stock plugin's,
# stored under hydra/sweeper/sampler by the import above.
SAMPLER_WHITELIST = ("hydra_plugins.hydra_optuna_sweeper.*", "optuna.samplers.*")


def sqlite_url(path: str) -> str:
    """`${gpuopt.sqlite:outputs/gpuopt.db}` -> `sqlite:////abs/outputs/gpuopt.db`: absolute from the
    current directory, so every run dir of the sweep (and a later report) reads the same file."""
    return f"sqlite:///{os.path.abspath(os.path.expanduser(str(path)))}"


if not OmegaConf.has_resolver("gpuopt.sqlite"):
    OmegaConf.register_resolver("gpuopt.sqlite", sqlite_url)


def _conf(
    options: type, name: str, types: dict[str, Any], *extra: Any, bases: tuple[type, ...] = ()
) -> type:
    """A structured config node of the options class's keys and defaults, not frozen (Hydra
    merges the command line's overrides into it); `types`: OmegaConf's types where the options'
    differ (tuples and mappings are OmegaConf's lists and dicts), a nested node's class."""
    fields: list[Any] = list(extra)
    for f in dataclasses.fields(options):
        kind = types.get(f.name, f.type)
        if dataclasses.is_dataclass(kind):  # a nested node (confirm, race)
            fields.append((f.name, kind, field(default_factory=kind)))
        elif f.default is dataclasses.MISSING:
            fields.append((f.name, kind, field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind, f.default))
    namespace = {"__doc__": options.__doc__, "__module__": __name__}
    return dataclasses.make_dataclass(name, fields, bases=bases, namespace=namespace)


# Each key's meaning: docs/searching.md's "Sweeper keys" table; defaults: SweeperOptions.
ConfirmConf = _conf(ConfirmOptions, "ConfirmConf", {})
RaceConf = _conf(RaceOptions, "RaceConf", {})


# gpuopt's default sampler: the stock TPE config with `multivariate: true` (Optuna's own TPE default
# for one objective). The stock config pins it false, which needs more trials to find the best
# configuration: to 99% of a replayed CPU grid's optimum 26.5 instead of 17.5 trials for the
# default sweep (docs/benchmarks.md, "Search efficiency"). `constant_liar: true` (Optuna's own
# mechanism for trials asked before others are told: it counts them as poor, so a batch does not
# ask the same point again): the race asks a screen of trials at once, and n_jobs > 1 asks
# batches; without it a raced 30-trial sweep without expert seeds needed a median 28 trials to 95%
# of a replayed grid's optimum, with it 19 (same docs section). A sequential sweep is unaffected
# (nothing is running when it asks). A separate node, so that `hydra/sweeper/sampler=tpe` stays the
# stock one and `=random` etc. replace it cleanly.
ConfigStore.instance().store(
    group="hydra/sweeper/sampler",
    name="gpuopt_tpe",
    node=TPESamplerConfig(multivariate=True, constant_liar=True),
    provider="gpuopt",
)


# The stock node's keys (gpuopt's defaults where they differ: `direction` null is each objective's
# goal, `storage` null in-memory, `study_name` null derived for gpuopt's own task, `n_trials` the
# study's total), then gpuopt's.
_STOCK = {f.name: f for f in dataclasses.fields(OptunaSweeperConf)}
GpuoptSweeperConf = _conf(
    SweeperOptions,
    "GpuoptSweeperConf",
    {
        "objectives": list[str] | None,
        "batch_keys": list[str] | None,
        "device_params": dict[str, dict[str, str]],
        "custom_search_space": _STOCK["custom_search_space"].type,
        "params": _STOCK["params"].type,
        "confirm": ConfirmConf,
        "race": RaceConf,
    },
    ("_target_", str, "gpuopt.sweeper.plugin.GpuoptSweeper"),
    ("defaults", list[Any], field(default_factory=lambda: [{"sampler": "gpuopt_tpe"}])),
    bases=(OptunaSweeperConf,),
)
ConfigStore.instance().store(
    group="hydra/sweeper", name="gpuopt", node=GpuoptSweeperConf, provider="gpuopt"
)


class GpuoptSweeper(OptunaSweeper):
    """hydra-optuna-sweeper's interface, delegating to `GpuoptSweeperImpl`; Hydra passes every
    `hydra.sweeper` key as a keyword."""

    def __init__(self, sampler: Any, **settings: Any) -> None:
        from gpuopt.sweeper.loop import GpuoptSweeperImpl

        with _one_line_errors():
            options = SweeperOptions.build(**settings)
        sampler = instantiate(sampler, _execution_whitelist_=SAMPLER_WHITELIST)
        self.sweeper = GpuoptSweeperImpl(sampler, options)

    def setup(self, **kwargs: Any) -> None:
        """The stock setup (it instantiates the launcher); a bad launcher setting
        (`hydra.launcher.nproc_per_node=0`) is one line, exit 2, before anything is created."""
        with _one_line_errors():
            super().setup(**kwargs)

    def sweep(self, arguments: list[str]) -> None:
        """Run the sweep; a bad setting or too many failed trials ends it with one clear line."""
        with _one_line_errors():
            return self.sweeper.sweep(arguments)


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """A bad setting (exit 2): one line on stderr, no traceback. An aborted sweep (exit 1): the
    last failing trial's exception and its traceback's tail (scripts and CI logs grep it), one line."""
    from gpuopt.sweeper.progress import SweepAborted

    try:
        yield
    except (ConfigError, InstantiationException) as exc:
        error = exc if isinstance(exc, ConfigError) else exc.__cause__  # Hydra's wrapper's cause
        if not isinstance(error, ConfigError):
            raise
        print(f"gpuopt: {mask_secrets(str(error))}", file=sys.stderr, flush=True)
        sys.exit(2)
    except SweepAborted as exc:
        if exc.failure:  # the last failing trial's exception, as the stock sweeper re-raises it
            print(exc.failure, file=sys.stderr, flush=True)
        print(f"gpuopt: sweep stopped: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
