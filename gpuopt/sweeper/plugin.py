"""The gpuopt Hydra sweeper: hydra-optuna-sweeper's keys and samplers, gpuopt's sweep loop.

Hydra imports this module on every run (plugin discovery), so it stays light: no optuna, no torch.
Every key of the stock `hydra/sweeper=optuna` works unchanged; the keys below them are gpuopt's."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from gpuopt.sweeper.options import SweeperOptions

# The sampler configs (tpe, random, grid, nsgaii, gp, cmaes, qmc, ...) are the stock plugin's,
# stored under hydra/sweeper/sampler by the import above.
SAMPLER_WHITELIST = ("hydra_plugins.hydra_optuna_sweeper.*", "optuna.samplers.*")


_DEFAULTS = SweeperOptions()  # the one default of each setting (gpuopt/sweeper/options.py)


def sqlite_url(path: str) -> str:
    """`${gpuopt.sqlite:outputs/gpuopt.db}` -> `sqlite:////abs/outputs/gpuopt.db`: absolute from the
    current directory, so every run dir of the sweep (and a later report) reads the same file."""
    return f"sqlite:///{os.path.abspath(os.path.expanduser(str(path)))}"


if not OmegaConf.has_resolver("gpuopt.sqlite"):
    OmegaConf.register_resolver("gpuopt.sqlite", sqlite_url)


# Each key's meaning: docs/searching.md's "Sweeper keys" table; defaults: SweeperOptions.
@dataclass
class ConfirmConf:
    """End-of-sweep re-measurement: the baseline and the top-k candidates, interleaved."""

    top_k: int = _DEFAULTS.confirm.top_k
    rounds: int = _DEFAULTS.confirm.rounds  # 0 turns it off
    max_share: float = _DEFAULTS.confirm.max_share
    target_halfwidth: float = _DEFAULTS.confirm.target_halfwidth
    in_process: bool = _DEFAULTS.confirm.in_process
    window_s: float = _DEFAULTS.confirm.window_s


@dataclass
class RaceConf:
    """The race: a space whose configurations share one process is raced in it (sweeper/race/)."""

    enabled: bool = _DEFAULTS.race.enabled
    window_s: float = _DEFAULTS.race.window_s
    slices: int = _DEFAULTS.race.slices
    finalists: int = _DEFAULTS.race.finalists
    floor: float = _DEFAULTS.race.floor
    screen: int = _DEFAULTS.race.screen


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


@dataclass
class GpuoptSweeperConf(OptunaSweeperConf):
    _target_: str = "gpuopt.sweeper.plugin.GpuoptSweeper"
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "gpuopt_tpe"}])

    # Stock keys whose defaults differ for gpuopt:
    # null: each objective's goal (gpuopt.core.metrics); a stock config's without `objectives`
    direction: Any = _DEFAULTS.direction
    # null: in-memory (the stock meaning); gpuopt's conf/config.yaml sets <output_dir>/gpuopt.db
    storage: Any | None = _DEFAULTS.storage
    # null: for gpuopt's own task derived from the workload, the space and the hardware
    study_name: str | None = _DEFAULTS.study_name
    n_trials: int = _DEFAULTS.n_trials  # the study's TOTAL: a re-run resumes up to it
    n_jobs: int = _DEFAULTS.n_jobs
    max_failure_rate: float = _DEFAULTS.max_failure_rate  # `error` trials only, from the 3rd on

    # gpuopt's keys
    objectives: list[str] | None = None
    device_aware: bool = _DEFAULTS.device_aware
    device_params: dict[str, dict[str, str]] = field(default_factory=dict)
    baseline: bool | None = _DEFAULTS.baseline
    gpuopt_task: bool = _DEFAULTS.gpuopt_task
    confirm: ConfirmConf = field(default_factory=ConfirmConf)
    race: RaceConf = field(default_factory=RaceConf)
    env_timeout_s: float = _DEFAULTS.env_timeout_s  # the env probe's limit (then no trimming)
    memory_axis: bool = _DEFAULTS.memory_axis
    memory_cap_mb: float | None = _DEFAULTS.memory_cap_mb
    seeding: bool = _DEFAULTS.seeding
    profile: bool = _DEFAULTS.profile
    batch_keys: list[str] | None = None
    artifacts: str | None = _DEFAULTS.artifacts
    heartbeat_interval: int | None = _DEFAULTS.heartbeat_interval
    grace_period: int | None = _DEFAULTS.grace_period


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
