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


@dataclass
class ConfirmConf:
    """End-of-sweep re-measurement: the baseline and the top-k candidates, interleaved."""

    top_k: int = _DEFAULTS.confirm.top_k  # candidates re-measured against the baseline
    rounds: int = _DEFAULTS.confirm.rounds  # first-stage rounds (A B1 B2); 0 turns it off
    # cap: confirmation runs <= this share of n_trials (fewer k until the first stage fits)
    max_share: float = _DEFAULTS.confirm.max_share
    # stop once the speedup's 95% CI is within +-this; still wider at the cap: "too noisy"
    target_halfwidth: float = _DEFAULTS.confirm.target_halfwidth
    # confirm configurations that can share a process in alternating in-process windows
    in_process: bool = _DEFAULTS.confirm.in_process
    window_s: float = _DEFAULTS.confirm.window_s  # one such window's length


@dataclass
class RaceConf:
    """The race: a space whose configurations share one process is raced in it (sweeper/race/)."""

    enabled: bool = _DEFAULTS.race.enabled  # false: every trial in a fresh process
    window_s: float = _DEFAULTS.race.window_s  # one screening window's length
    slices: int = _DEFAULTS.race.slices  # screening windows per candidate
    finalists: int = _DEFAULTS.race.finalists  # candidates measured as whole trials after it
    floor: float = _DEFAULTS.race.floor  # ...that read this share of the baseline or faster
    screen: int = _DEFAULTS.race.screen  # candidates per screen (a longer sweep: rounds of them)


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
    # null: each objective's goal (gpuopt.core.metrics). Given without `objectives` (a stock config):
    # the first len(direction) default objectives, or the task's plain float/list return values.
    direction: Any = _DEFAULTS.direction
    # null: in-memory, nothing kept (the stock meaning; "memory" says the same). gpuopt's own
    # conf/config.yaml sets the SQLite file <output_dir>/gpuopt.db.
    storage: Any | None = _DEFAULTS.storage
    # null: for gpuopt's own task (gpuopt_task) derived from the workload (model choice, search
    # preset), a hash of the search space and a hardware fingerprint; else Optuna's own name.
    study_name: str | None = _DEFAULTS.study_name
    # TOTAL trials of the study: a re-run of the same command resumes up to it
    n_trials: int = _DEFAULTS.n_trials
    n_jobs: int = _DEFAULTS.n_jobs  # parallel trials need a process launcher; one GPU: interference
    # Stop once more than this share of the finished trials ended with status `error` (from the 3rd
    # trial on). oom/diverged trials are results, not failures, and never count.
    max_failure_rate: float = _DEFAULTS.max_failure_rate

    # gpuopt additions
    # Metric names with a goal (gpuopt.core.metrics), in Optuna's value order. null: throughput_amortized, utilization.
    objectives: list[str] | None = None  # (SweeperOptions.objectives)
    # Drop choices that `python -m gpuopt.env --json` flags as poor on this machine from the
    # preset's params (command-line sweep arguments are always taken as written).
    device_aware: bool = _DEFAULTS.device_aware
    # Extra params searched only when trials run on that device type (cpu | cuda | mps).
    device_params: dict[str, dict[str, str]] = field(default_factory=dict)
    # Run the user's config as composed first, marked baseline=True (once per study). null: on
    # when gpuopt measures the app (see SweeperOptions.measured), off for an app's own value.
    baseline: bool | None = _DEFAULTS.baseline
    # True in gpuopt's conf/config.yaml: the task is gpuopt's (its config schema, a TrialResult):
    # the study name is derived when not given and the composed config is checked before the study.
    gpuopt_task: bool = _DEFAULTS.gpuopt_task
    confirm: ConfirmConf = field(default_factory=ConfirmConf)
    # Race the trials in one process where the space allows (sweeper/race/); race.enabled=false:
    # one fresh process per trial
    race: RaceConf = field(default_factory=RaceConf)
    # Seconds `python -m gpuopt.env --json` may take before it is given up (no filtering then).
    env_timeout_s: float = _DEFAULTS.env_timeout_s
    # Memory-aware batch axis and expert seeding after the baseline (gpuopt/sweeper/options.py).
    memory_axis: bool = _DEFAULTS.memory_axis
    memory_cap_mb: float | None = _DEFAULTS.memory_cap_mb
    seeding: bool = _DEFAULTS.seeding
    profile: bool = _DEFAULTS.profile  # profile the baseline and the best (gpuopt's own task)
    # An app's keys whose product is its global batch per rank, the micro-batch first, e.g.
    # [data.batch_size, trainer.accumulate_grad_batches] (docs/same-training.md).
    batch_keys: list[str] | None = None
    # Each trial's files in Optuna's artifact store: auto = artifacts/ beside the study's SQLite or
    # journal file; a directory; null: off (gpuopt/sweeper/trial_artifacts.py).
    artifacts: str | None = _DEFAULTS.artifacts
    # Several workers on one study (README): a heartbeat every heartbeat_interval seconds (null/0:
    # off); a RUNNING trial without one for grace_period seconds (null: 2 x interval) is failed
    # and its params re-queued.
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
