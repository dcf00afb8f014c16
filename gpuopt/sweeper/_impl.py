"""The gpuopt sweep loop, on hydra-optuna-sweeper's machinery.

Reused from the stock plugin: sampler configs, `create_params_from_overrides` (Hydra sweep syntax ->
Optuna distributions), `_get_directions`, grid handling. Replaced: the loop, because gpuopt needs
a baseline trial, failures told as data (constraints), resume of killed sweeps, a confirmation
round, and outputs a user can act on. The sweeping process never imports torch: the trial engine
runs in the launcher's processes and sends back a picklable `TrialResult`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.storages._heartbeat import get_heartbeat_thread
from optuna.trial import FrozenTrial, Trial, TrialState

from gpuopt.result import (
    ATTR_BASELINE,
    ATTR_OVERRIDES,
    ATTR_REASON,
    ATTR_STATUS,
    STUDY_CONFIRMATION,
    STUDY_DIRECTIONS,
    STUDY_HARDWARE,
    STUDY_OBJECTIVES,
)
from gpuopt.secrets import mask_secrets

from . import confirm as confirm_mod
from . import hardware, resume
from . import storage as storage_mod
from .export import overrides_to_experiment, stock_results, write_experiment
from .objectives import SweepConfigError, TrialOutcome, resolve_objectives
from .record import ATTR_TRACEBACK, outcome_of, pick_best, record_trial  # noqa: F401
from .record import feasible as _feasible
from .search_space import (
    baseline_params,
    current_value,
    drop_poor_choices,
    override_text,
    parse_entry,
    parser,
    preset_without_user_keys,
    select_device_params,
)
from .summary import progress_line, render

log = logging.getLogger("gpuopt.sweeper")

MIN_TRIALS_FOR_FAILURE_RATE = 3


class SweepAborted(RuntimeError):
    """Too many trials ended with status `error` (hydra.sweeper.max_failure_rate)."""


class GpuoptSweeperImpl(OptunaSweeperImpl):
    def __init__(
        self,
        *,
        sampler: Any,
        direction: Any,
        storage: Any | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        custom_search_space: str | None,
        params: DictConfig | None,
        objectives: Any = None,
        device_aware: bool = True,
        device_params: Any = None,
        baseline: bool = True,
        confirm: Any = None,
        env_timeout_s: float = 120.0,
        heartbeat_interval: int | None = 60,
        grace_period: int | None = None,
    ) -> None:
        super().__init__(
            sampler,
            direction,
            storage,
            study_name,
            n_trials,
            n_jobs,
            max_failure_rate,
            custom_search_space,
            params,
        )
        self.objectives = list(objectives) if objectives is not None else None
        self.device_aware = device_aware
        self.device_params = (
            OmegaConf.to_container(device_params)
            if OmegaConf.is_config(device_params)
            else (device_params or {})
        )
        self.baseline_enabled = baseline
        confirm = (
            OmegaConf.to_container(confirm) if OmegaConf.is_config(confirm) else (confirm or {})
        )
        self.confirm_top_k = int(confirm.get("top_k", 2))
        self.confirm_rounds = int(confirm.get("rounds", 2))
        self.confirm_max_share = float(confirm.get("max_share", 0.25))
        self.env_timeout_s = env_timeout_s
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period
        # Same grace as the storage's heartbeat check (Optuna's default: 2 x interval).
        self._ownerless = resume.OwnerlessWatch(grace_period or 2 * (heartbeat_interval or 0))
        self._labels_checked = False
        self._created_study = False
        # Grid sweeps whose composed config is one of the grid's points: those params, until the
        # grid reaches that point and the trial is marked baseline (no extra trial).
        self._baseline_point: dict[str, Any] | None = None
        if n_jobs < 1:
            raise SweepConfigError("hydra.sweeper.n_jobs", n_jobs, "an integer >= 1")

    # ---- setup ---------------------------------------------------------------------------------

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        _mask_config_secrets(config)  # every trial's .hydra/*.yaml and multirun.yaml copy it
        self._keep_gpus_visible()

    def _keep_gpus_visible(self) -> None:
        """submitit's local launcher hides every GPU unless told which: give trials ours."""
        params = getattr(self.launcher, "params", None)
        if getattr(self.launcher, "_EXECUTOR", None) != "local" or not isinstance(params, dict):
            return
        if hasattr(self.launcher, "_device_plan"):
            return  # gpuopt's fresh_process launcher sets each job's GPUs itself
        if params.get("gpus_per_node") is not None or params.get("setup"):
            return  # the user chose
        params["setup"] = [hardware.gpu_setup_command(dict(os.environ))]

    # ---- sweep ---------------------------------------------------------------------------------

    def sweep(self, arguments: list[str]) -> None:
        t_start = time.monotonic()
        names, directions = resolve_objectives(self.objectives, self.direction)
        facts = hardware.hardware_facts()
        device_type = self._device_type(facts)
        probe = self._probe_env()
        if probe.device_type and self._configured_device() in (None, "auto"):
            device_type = probe.device_type

        self.dropped: list[tuple[str, str, str]] = []
        distributions, fixed_params, fixed_overrides, is_grid = self._search_space(
            arguments, probe, device_type
        )
        self._validate_overrides(distributions, fixed_params, fixed_overrides)

        hw_id = hardware.fingerprint(facts)
        storage_url = self._storage_url()
        study_name = self.study_name or hardware.default_study_name(
            self._choice("model") or str(self.config.hydra.job.name), self._choice("search"), hw_id
        )
        study = self._open_study(study_name, storage_url, names, directions, hw_id, facts, probe)
        self._check_sampler(directions)

        self._recover(study)
        trials = study.get_trials(deepcopy=False)
        to_go = resume.trials_to_go(trials, self.n_trials)
        # A new study: its creator enqueues the baseline (workers started with it leave that to
        # it); an existing study without one gets it from whoever resumes it.
        if to_go and self.baseline_enabled and not resume.has_baseline(trials):
            point = self._grid_baseline_point(distributions) if is_grid else None
            if point is not None:
                # Every worker marks it when its grid trial comes up: at most one trial has it.
                self._baseline_point = point
                log.info("baseline: the configuration as composed is a grid point; marked when run")
            elif self._created_study or trials:
                self._enqueue_baseline(study, distributions, is_grid)
                trials = study.get_trials(deepcopy=False)
        if is_grid:
            # The grid's size, plus a baseline that is not one of its points.
            grid_size = len(self.sampler._all_grids) + sum(  # type: ignore[attr-defined]
                1
                for t in trials
                if t.user_attrs.get(ATTR_BASELINE)
                and t.system_attrs.get("grid_id") == -1
                and not t.user_attrs.get(resume.INTERRUPTED_ATTR)
            )
            if grid_size < self.n_trials:
                log.info(
                    "GridSampler: n_trials %d -> %d (the grid's size)", self.n_trials, grid_size
                )
            self.n_trials = min(self.n_trials, grid_size)
        to_go = resume.trials_to_go(trials, self.n_trials)
        done_before = self.n_trials - to_go
        if done_before:
            log.info(
                "study %r has %d/%d counted trials: resuming",
                study_name,
                done_before,
                self.n_trials,
            )

        log.info("Study name: %s", study_name)
        log.info("Storage: %s", storage_mod.display(storage_url))
        log.info("Sampler: %s", type(self.sampler).__name__)
        log.info(
            "Objectives: %s",
            ", ".join(f"{n} ({d})" for n, d in zip(names, directions, strict=False)),
        )
        self._run_trials(
            study,
            to_go,
            done_before,
            distributions,
            fixed_params,
            fixed_overrides,
            names,
            directions,
            t_start,
        )

        confirmation = self._confirm_if_last(study, names, directions)
        self._write_outputs(
            study, study_name, storage_url, names, directions, confirmation, t_start
        )

    # ---- search space ----------------------------------------------------------------------------

    def _choice(self, group: str) -> str | None:
        choices = self.config.hydra.runtime.choices
        value = choices.get(group) if choices is not None else None
        return str(value) if value is not None else None

    def _configured_device(self) -> str | None:
        value = OmegaConf.select(self.config, "device.type", default=None)
        return str(value) if value is not None else None

    def _device_type(self, facts: dict[str, Any]) -> str:
        return hardware.detect_device_type(self._configured_device(), facts)

    def _probe_env(self) -> hardware.EnvProbe:
        if not self.device_aware or not (self.params or self.device_params):
            return hardware.EnvProbe()
        probe = hardware.probe_env(self.env_timeout_s)
        if probe.error:
            log.warning("device-aware presets off: %s", probe.error)
        return probe

    def _search_space(self, arguments: list[str], probe: hardware.EnvProbe, device_type: str):
        preset = {str(k): str(v) for k, v in (self.params or {}).items()}
        extra = select_device_params(self.device_params, device_type)
        preset.update({k: v for k, v in extra.items() if k not in preset})
        for key, text in preset.items():
            parse_entry(key, text, "hydra.sweeper.params")
        if self.device_aware and probe.poor_choices:
            filtered = drop_poor_choices(preset, probe.poor_choices)
            for key, choice, reason in filtered.dropped:
                log.info("device-aware: dropped %s=%s from the search (%s)", key, choice, reason)
            for key in filtered.removed_keys:
                log.info(
                    "device-aware: %s not searched (every choice is poor here); the configured value stays",
                    key,
                )
            preset = filtered.params
            self.dropped = filtered.dropped
        cli_keys = []
        for arg in arguments:
            try:
                cli_keys.append(parser().parse_override(arg).key_or_group)
            except Exception as exc:
                raise SweepConfigError(
                    "command line", arg, f"a Hydra override ({str(exc).splitlines()[0]})"
                ) from None
        preset = preset_without_user_keys(preset, cli_keys)
        params_conf = [f"{k}={v}" for k, v in preset.items()] + list(arguments)
        try:
            distributions, fixed_params, fixed_overrides = create_params_from_overrides(params_conf)
        except (ValueError, AssertionError, NotImplementedError) as exc:
            raise SweepConfigError(
                "hydra.sweeper.params", params_conf, f"sweeps Optuna can sample ({exc})"
            ) from None
        for name in fixed_params:
            distributions.pop(name, None)
        is_grid = (
            isinstance(self.sampler, functools.partial)
            and self.sampler.func == optuna.samplers.GridSampler
        )
        if is_grid:
            try:
                grid = {n: self._to_grid_sampler_choices(d) for n, d in distributions.items()}
            except (ValueError, AssertionError) as exc:
                raise SweepConfigError(
                    "hydra.sweeper.sampler", "grid", f"discrete params only ({exc})"
                ) from None
            self.sampler = self.sampler(grid)
        return distributions, fixed_params, fixed_overrides, is_grid

    def _validate_overrides(
        self, distributions: dict, fixed_params: dict, fixed_overrides: list
    ) -> None:
        """Compose the trial config for every choice before any trial: unknown keys, bad group
        options and wrong types fail here with the override that caused them."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        columns: dict[str, list[Any]] = {}
        for name, dist in distributions.items():
            if isinstance(dist, CategoricalDistribution):
                columns[name] = list(dist.choices)
            elif isinstance(dist, (IntDistribution, FloatDistribution)):
                columns[name] = [dist.low, dist.high]
        fixed = [f"{k}={v}" for k, v in fixed_params.items()] + list(fixed_overrides)
        rows = max((len(v) for v in columns.values()), default=1)
        loader = self.hydra_context.config_loader
        for i in range(rows):
            overrides = [override_text(k, v[i % len(v)]) for k, v in columns.items()]
            error = _compose_error(loader, self.config, overrides + fixed)
            if error is None:
                continue
            # Name the override at fault: each one alone (with the fixed ones) until one fails.
            culprit = next(
                (
                    (o, e)
                    for o in overrides
                    if (e := _compose_error(loader, self.config, [o, *fixed]))
                ),
                None,
            )
            if culprit is None:
                culprit = next(
                    ((o, e) for o in fixed if (e := _compose_error(loader, self.config, [o]))),
                    (" ".join(overrides + fixed), error),
                )
            raise SweepConfigError(
                "sweep override", culprit[0], f"keys and options of this config ({culprit[1]})"
            )

    # ---- study -----------------------------------------------------------------------------------

    def _storage_url(self) -> Any:
        if self.storage is None:
            output_dir = (
                OmegaConf.select(self.config, "output_dir", default=None)
                or os.environ.get("GPUOPT_OUTPUT_DIR")
                or "outputs"
            )
            cwd = OmegaConf.select(self.config, "hydra.runtime.cwd", default=None)
            self.storage = hardware.default_storage(str(output_dir), cwd)
        elif str(self.storage) == "memory":
            self.storage = None
        return self.storage

    def _open_study(
        self,
        name: str,
        storage: Any,
        names: list[str],
        directions: list[str],
        hw_id: str,
        facts: dict[str, Any],
        probe: hardware.EnvProbe,
    ) -> optuna.Study:
        opened = storage_mod.open_storage(storage, self.heartbeat_interval, self.grace_period)
        try:
            study = optuna.load_study(study_name=name, storage=opened, sampler=self.sampler)
            existing = True
        except KeyError:
            try:
                study = optuna.create_study(
                    study_name=name, storage=opened, sampler=self.sampler, directions=directions
                )
                existing = False
                self._created_study = True
            except optuna.exceptions.DuplicatedStudyError:  # another worker created it just now
                study = optuna.load_study(study_name=name, storage=opened, sampler=self.sampler)
                existing = True
        if storage is None:
            self.storage = "memory"
        attrs = study.user_attrs
        if existing:
            stored_dirs = [d.name.lower() for d in study.directions]
            stored_names = attrs.get(STUDY_OBJECTIVES)
            if stored_dirs != directions or (
                stored_names and not _plain_names(stored_names) and stored_names != names
            ):
                raise SweepConfigError(
                    "hydra.sweeper.objectives",
                    names,
                    f"the objectives of existing study {name!r}: {stored_names or '?'} {stored_dirs} "
                    "(or give another hydra.sweeper.study_name)",
                )
            hw = attrs.get(STUDY_HARDWARE) or {}
            if hw.get("id") and hw.get("id") != hw_id:
                log.warning(
                    "study %r was measured on other hardware (%s, now %s): its trials do not compare with "
                    "this machine's",
                    name,
                    hw.get("id"),
                    hw_id,
                )
            return study
        study.set_user_attr(STUDY_OBJECTIVES, names)
        study.set_user_attr(STUDY_DIRECTIONS, directions)
        env = {k: v for k, v in probe.data.items() if k != "poor_choices"}
        hardware_attr = {
            "id": hw_id,
            **facts,
            "env": env,
            "poor_choices": probe.poor_choices,
            "dropped": [list(d) for d in self.dropped],
        }
        study.set_user_attr(STUDY_HARDWARE, json.loads(json.dumps(hardware_attr, default=str)))
        _set_metric_names(study, names)
        return study

    def _check_sampler(self, directions: list[str]) -> None:
        if len(directions) > 1 and isinstance(self.sampler, optuna.samplers.CmaEsSampler):
            raise SweepConfigError(
                "hydra/sweeper/sampler",
                "cmaes",
                f"a multi-objective sampler for {len(directions)} objectives (tpe, nsgaii, gp, random, qmc), "
                "or one objective: hydra.sweeper.objectives=[throughput]",
            )

    def _grid_baseline_point(self, distributions: dict) -> dict[str, Any] | None:
        """The composed config's params when every grid key holds one of its grid values."""
        fitting, outside = baseline_params(self.config, distributions)
        return fitting if not outside and set(fitting) == set(distributions) else None

    def _enqueue_baseline(self, study: optuna.Study, distributions: dict, is_grid: bool) -> None:
        fitting, outside = baseline_params(self.config, distributions)
        for key in outside:
            log.info(
                "baseline: %s=%s is outside the search space: the baseline keeps it as configured",
                key,
                current_value(self.config, key),
            )
        system_attrs: dict[str, Any] = {"fixed_params": fitting}
        if is_grid:
            # Some key of the config is not a grid value. GridSampler hands grid points out by
            # trial number, so a pinned baseline would take a point twice and leave one out: the
            # baseline runs as composed, outside the grid (grid_id -1, the attrs GridSampler
            # needs), one trial on top of the grid.
            system_attrs = {"fixed_params": {}, "grid_id": -1, "search_space": {}}
        # What study.enqueue_trial does, plus those attrs.
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.WAITING,
                system_attrs=system_attrs,
                user_attrs={ATTR_BASELINE: True},
            )
        )

    # ---- trials ----------------------------------------------------------------------------------

    def _recover(self, study: optuna.Study) -> None:
        """Fail and re-queue trials whose worker died: on this host (pid gone) or anywhere
        (heartbeat stale, or no owner, for grace_period)."""
        for numbers, cause in (
            (resume.recover_interrupted(study), "a killed sweep on this host"),
            (resume.fail_stale(study), "a worker whose heartbeat stopped"),
            (
                self._ownerless.fail_dead(study)
                if storage_mod.heartbeat_on(study._storage)
                else [],
                "a worker that died right after asking",
            ),
        ):
            if numbers:
                log.warning(
                    "trials %s were interrupted by %s: marked FAIL, their params enqueued again",
                    numbers,
                    cause,
                )

    @staticmethod
    def _others_in_flight(study: optuna.Study, owner: dict) -> list[FrozenTrial]:
        return [
            t
            for t in resume.in_flight(study.get_trials(deepcopy=False))
            if t.system_attrs.get(resume.OWNER_ATTR) != owner
        ]

    def _ask(self, study: optuna.Study, n: int, owner: dict) -> tuple[list[Trial], bool]:
        """Up to n trials this worker may run, and whether the study is full (see resume.py's rule:
        a trial with n_trials counted-or-waiting trials below its number is void, not run)."""
        out: list[Trial] = []
        while len(out) < n:
            with warnings.catch_warnings():
                # "Heartbeat of storage is supposed to be used with Study.optimize": gpuopt runs
                # the heartbeat thread itself, around each launch.
                warnings.simplefilter("ignore")
                trial = study.ask()
            if storage_mod.heartbeat_on(study._storage):
                # Beat at once: a trial that never beat is invisible to the stale check.
                study._storage.record_heartbeat(trial._trial_id)
            study._storage.set_trial_system_attr(trial._trial_id, resume.OWNER_ATTR, owner)
            trials = study.get_trials(deepcopy=False)
            if resume.is_surplus(trial.number, trials, self.n_trials):
                resume.void(study, trial, f"surplus: other workers hold n_trials={self.n_trials}")
                log.info("trial #%d not run: the study's n_trials are taken", trial.number)
                return out, True
            if trial.user_attrs.get(ATTR_BASELINE) and resume.duplicate_baseline(
                trial.number, trials
            ):
                resume.void(study, trial, "duplicate baseline (enqueued by two workers at once)")
                continue
            out.append(trial)
        return out, False

    def _run_trials(
        self,
        study,
        to_go,
        done_before,
        distributions,
        fixed_params,
        fixed_overrides,
        names,
        directions,
        t_start,
    ) -> None:
        """Ask, launch, record until the study holds n_trials counted trials.

        The study, not this process, is the source of truth: other workers may share it (a
        PostgreSQL or journal storage), so what is left is re-read before every batch.
        """
        finished = errors = 0
        t_loop = time.monotonic()
        owner = resume.this_owner()
        best = _best(study, directions)  # read once; then kept up to date from this run's trials
        sign = 1 if directions[0] == "maximize" else -1
        full = False
        first = True
        waiting_logged = False
        while not full:
            if not first:
                self._recover(study)
                to_go = resume.trials_to_go(study.get_trials(deepcopy=False), self.n_trials)
            first = False
            if to_go <= 0:
                # n_trials are taken; trials of other workers may still be running. With heartbeats
                # on, stay until they finish: a worker that died under one has its trial re-queued
                # after grace_period, and this worker runs it.
                others = self._others_in_flight(study, owner)
                if not others or not storage_mod.heartbeat_on(study._storage):
                    break
                if not waiting_logged:
                    log.info(
                        "waiting for %d trial(s) of other workers (re-run here if their worker "
                        "dies)",
                        len(others),
                    )
                    waiting_logged = True
                time.sleep(min(2.0, float(self.heartbeat_interval or 2)))
                continue
            trials, full = self._ask(study, min(self.n_jobs, to_go), owner)
            if not trials:
                break
            beats = [get_heartbeat_thread(t._trial_id, study._storage) for t in trials]
            for beat in beats:
                beat.start()  # records a beat at once, then every heartbeat_interval seconds
            try:
                overrides = self._configure(trials, distributions, fixed_params, fixed_overrides)
                returns = self._launch(overrides, [t.number for t in trials])
                for trial, trial_overrides, ret in zip(trials, overrides, returns, strict=False):
                    outcome = self._outcome(ret, names, directions)
                    self._tell(study, trial, trial_overrides, ret, outcome, owner)
                    if (
                        outcome.feasible
                        and outcome.values
                        and (best is None or sign * outcome.values[0] > sign * best[1][0])
                    ):
                        best = (trial.number, outcome.values)
                    finished += 1
                    errors += outcome.failed
                    done = done_before + finished
                    per_trial = (time.monotonic() - t_loop) / finished
                    log.info(
                        progress_line(
                            done,
                            self.n_trials,
                            trial.number,
                            outcome.status,
                            names,
                            outcome.values,
                            time.monotonic() - t_start,
                            per_trial * max(0, self.n_trials - done),
                            best,
                            bool(trial.user_attrs.get(ATTR_BASELINE)),
                            outcome.user_attrs.get(ATTR_REASON),
                        )
                    )
            finally:
                for beat in beats:
                    beat.join()
            if (
                errors
                and finished >= min(MIN_TRIALS_FOR_FAILURE_RATE, self.n_trials)
                and errors / finished > self.max_failure_rate
            ):
                raise SweepAborted(
                    f"{errors} of {finished} trials ended with status error (> hydra.sweeper.max_failure_rate="
                    f"{self.max_failure_rate}); see their 'reason' user attrs: optuna trials --study-name "
                    f"{study.study_name} --storage {storage_mod.display(self.storage)}"
                )

    def _configure(
        self, trials: list[Trial], distributions: dict, fixed_params: dict, fixed_overrides: list
    ) -> list[list[str]]:
        out = []
        for trial in trials:
            is_baseline = bool(trial.user_attrs.get(ATTR_BASELINE))
            pinned = (
                trial.storage.get_trial_system_attrs(trial._trial_id).get("fixed_params") or {}
                if is_baseline
                else {}
            )
            for name, dist in distributions.items():
                if is_baseline and name not in pinned:
                    continue  # the baseline keeps the configured value of keys outside the space
                trial._suggest(name, dist)
            for name, value in fixed_params.items():
                trial.set_user_attr(name, value)  # as the stock sweeper does
            if (
                self._baseline_point is not None
                and not is_baseline
                and trial.params == self._baseline_point
            ):
                self._baseline_point = None
                if not resume.has_baseline(trial.study.get_trials(deepcopy=False)):
                    trial.set_user_attr(ATTR_BASELINE, True)  # the grid reached the baseline
            if self.custom_search_space_extender and not is_baseline:
                self.custom_search_space_extender(self.config, trial)
            overlap = trial.params.keys() & fixed_params.keys()
            if overlap:
                raise SweepConfigError(
                    "hydra.sweeper.params", sorted(overlap), "each key either searched or fixed"
                )
            out.append(
                [override_text(k, v) for k, v in trial.params.items()]
                + [f"{k}={v}" for k, v in fixed_params.items()]
                + list(fixed_overrides)
            )
        return out

    def _launch(
        self, overrides: list[list[str]], numbers: list[int]
    ) -> list[JobReturn | BaseException]:
        """Launch a batch; a launcher that raises does not end the sweep (jobs retried one by one)."""
        try:
            returns = list(self.launcher.launch(overrides, initial_job_idx=numbers[0]))
            if len(returns) == len(overrides):
                return returns
            raise RuntimeError(
                f"launcher returned {len(returns)} results for {len(overrides)} jobs"
            )
        except Exception as exc:
            if len(overrides) == 1:
                log.warning("launcher failed: %s: %s", type(exc).__name__, exc)
                return [exc]
            log.warning("launcher failed for a batch (%s); launching its jobs one by one", exc)
            return [self._launch([o], [n])[0] for o, n in zip(overrides, numbers, strict=False)]

    @staticmethod
    def _outcome(
        ret: JobReturn | BaseException, names: list[str], directions: list[str]
    ) -> TrialOutcome:
        return outcome_of(ret, names, directions)

    def _tell(
        self,
        study,
        trial: Trial,
        overrides: list[str],
        ret: Any,
        outcome: TrialOutcome,
        owner: dict,
    ) -> None:
        record_trial(study, trial, overrides, ret, outcome)
        if outcome.failed:
            return
        if outcome.plain and not self._labels_checked:
            self._labels_checked = True  # one study read per sweep, not per trial
        else:
            return
        if study.user_attrs.get(STUDY_OBJECTIVES) and not _plain_names(
            study.user_attrs[STUDY_OBJECTIVES]
        ):
            # A stock-style task: its values are not gpuopt metrics.
            n = len(outcome.values or [])
            labels = ["value"] if n == 1 else [f"value_{i}" for i in range(n)]
            study.set_user_attr(STUDY_OBJECTIVES, labels)
            _set_metric_names(study, labels)

    # ---- confirmation ------------------------------------------------------------------------------

    def _confirm_if_last(
        self, study: optuna.Study, names: list[str], directions: list[str]
    ) -> dict[str, Any] | None:
        """The confirmation round runs in the last worker to finish (the others' trials are done)."""
        others = self._others_in_flight(study, resume.this_owner())
        if others:
            log.info(
                "%d trial(s) still running in other workers: the last worker to finish runs the "
                "confirmation round",
                len(others),
            )
            previous = study.user_attrs.get(STUDY_CONFIRMATION)
            return previous if isinstance(previous, dict) else None
        return self._confirm(study, names, directions)

    def _confirm(
        self, study: optuna.Study, names: list[str], directions: list[str]
    ) -> dict[str, Any] | None:
        if _plain_names(study.user_attrs.get(STUDY_OBJECTIVES)):
            return None  # a stock-style task: its values are not noisy measurements to confirm
        trials = study.get_trials(deepcopy=False, states=[TrialState.COMPLETE])
        feasible = [t for t in trials if _feasible(t) and t.values]
        baseline = next((t for t in feasible if t.user_attrs.get(ATTR_BASELINE)), None)
        previous = study.user_attrs.get(STUDY_CONFIRMATION)
        counted = sum(1 for t in study.get_trials(deepcopy=False) if resume.counted(t))
        if previous and previous.get("after_trials") == counted:
            return previous  # nothing new since the last confirmation
        if baseline is None:
            return None
        sign = 1 if directions[0] == "maximize" else -1
        seen = {_key(baseline.params)}
        candidates = []
        for t in sorted(
            (t for t in feasible if not t.user_attrs.get(ATTR_BASELINE)),
            key=lambda t: -sign * t.values[0],
        ):
            if _key(t.params) not in seen:
                seen.add(_key(t.params))
                candidates.append(t)
        confirm_plan = confirm_mod.plan(
            self.confirm_top_k,
            self.confirm_rounds,
            self.confirm_max_share,
            self.n_trials,
            len(candidates),
        )
        if confirm_plan is None:
            if self.confirm_rounds > 0 and candidates:
                log.info(
                    "confirmation round skipped: %.0f%% of n_trials=%d allows fewer than 2 runs "
                    "(hydra.sweeper.confirm.max_share)",
                    100 * self.confirm_max_share,
                    self.n_trials,
                )
            return None
        if not resume.claim_confirmation(study, counted):
            log.info("another worker runs the confirmation round")
            return previous if isinstance(previous, dict) else None
        chosen = [baseline, *candidates[: confirm_plan.top_k]]
        configs = [
            confirm_mod.ConfirmedConfig(
                label="baseline" if i == 0 else f"candidate{i}",
                trial_number=t.number,
                params=dict(t.params),
                overrides=list(t.user_attrs.get(ATTR_OVERRIDES) or []),
                sweep_values=[s.values[0] for s in feasible if _key(s.params) == _key(t.params)],
            )
            for i, t in enumerate(chosen)
        ]
        by_label = {c.label: c for c in configs}
        order = confirm_mod.schedule([c.label for c in configs], confirm_plan.rounds)
        log.info(
            "confirmation: %d round(s) of %s (interleaved) on %s",
            confirm_plan.rounds,
            ", ".join(c.label for c in configs),
            names[0],
        )
        for i, label in enumerate(order):
            cfg = by_label[label]
            overrides = [*cfg.overrides, f"hydra.sweep.subdir=confirm/{i:02d}_{label}"]
            ret = self._launch([overrides], [10_000 + i])[0]
            outcome = self._outcome(ret, names, directions)
            cfg.confirm_statuses.append(outcome.status)
            if outcome.feasible and outcome.values:
                cfg.confirm_values.append(outcome.values[0])
            log.info(
                "confirmation %d/%d %s: %s",
                i + 1,
                len(order),
                label,
                f"{names[0]}={outcome.values[0]:.4g}"
                if outcome.feasible and outcome.values
                else outcome.status,
            )
        record = {
            "objective": names[0],
            "direction": directions[0],
            "rounds": confirm_plan.rounds,
            "top_k": confirm_plan.top_k,
            "after_trials": counted,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "sweep_dir": str(self.config.hydra.sweep.dir),
            "configs": [vars(c) for c in configs],
            **confirm_mod.compare(configs, directions[0]),
        }
        record = json.loads(json.dumps(record, default=str))
        study.set_user_attr(STUDY_CONFIRMATION, record)
        return record

    # ---- outputs -----------------------------------------------------------------------------------

    def _app_command(self) -> str:
        """How the user starts this task: `python -m gpuopt.run` for gpuopt, the job name otherwise."""
        if OmegaConf.select(self.config, "measure", default=None) is not None:
            return "python -m gpuopt.run"
        return f"python {self.config.hydra.job.name}.py"

    def _write_outputs(
        self, study, study_name, storage_url, names, directions, confirmation, t_start
    ) -> None:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        all_trials = study.get_trials(deepcopy=False)
        complete = [t for t in all_trials if t.state == TrialState.COMPLETE]
        feasible = [t for t in complete if _feasible(t) and t.values]
        pareto = [t for t in study.best_trials if _feasible(t)] if feasible else []
        baseline = next((t for t in feasible if t.user_attrs.get(ATTR_BASELINE)), None)
        best = pick_best(feasible, pareto, directions, confirmation)
        counts: dict[str, int] = {}
        for t in all_trials:
            status = t.user_attrs.get(ATTR_STATUS) or t.state.name.lower()
            if t.user_attrs.get(resume.INTERRUPTED_ATTR):
                status = "interrupted"
            counts[status] = counts.get(status, 0) + 1

        ranked = [best] if best is not None and len(directions) < 2 else pareto
        results = stock_results(
            directions,
            ranked,
            {
                "study_name": study_name,
                "storage": storage_mod.display(storage_url),
                "objectives": names,
                "directions": directions,
                "best_trial": best.number if best is not None else None,
            },
        )
        OmegaConf.save(
            OmegaConf.create(json.loads(json.dumps(results, default=str))),
            sweep_dir / "optimization_results.yaml",
        )

        best_yaml = None
        notes = []
        if best is not None:
            groups = [
                k for k in self.config.hydra.runtime.choices if not str(k).startswith("hydra/")
            ]
            body, skipped = overrides_to_experiment(
                best.user_attrs.get(ATTR_OVERRIDES) or [], groups
            )
            header = [
                f"Best configuration of study {study_name} (trial #{best.number}): "
                + ", ".join(f"{n}={v:.4g}" for n, v in zip(names, best.values, strict=False)),
                f"Reproduce: {self._app_command()} --config-dir {sweep_dir} +experiment=best",
            ]
            if skipped:
                header.append(f"Not expressible here (apply by hand): {' '.join(skipped)}")
            best_yaml = str(write_experiment(sweep_dir / "experiment" / "best.yaml", body, header))
        if counts.get("oom") or counts.get("diverged"):
            notes.append(
                "infeasible trials (oom/diverged) are kept in the study with constraints > 0: samplers avoid that region"
            )
        text = render(
            study_name=study_name,
            storage=storage_mod.display(storage_url),
            sweep_dir=str(sweep_dir),
            names=names,
            directions=directions,
            counts=counts,
            baseline=baseline,
            best=best,
            pareto=pareto,
            confirmation=confirmation,
            best_yaml=best_yaml,
            elapsed_s=time.monotonic() - t_start,
            notes=notes,
        )
        (sweep_dir / "summary.txt").write_text(text + "\n")
        print(text, flush=True)


# ---- helpers --------------------------------------------------------------------------------------


def _compose_error(loader: Any, config: DictConfig, overrides: list[str]) -> str | None:
    """None if the trial config composes with these overrides, else the first lines of the error."""
    try:
        loader.load_sweep_config(config, overrides)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        return " ".join(lines[:3]) or type(exc).__name__
    return None


def _plain_names(labels: Any) -> bool:
    return isinstance(labels, list) and all(str(x).startswith("value") for x in labels)


def _set_metric_names(study: optuna.Study, names: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # experimental API: never worth failing a sweep over
        with contextlib.suppress(Exception):
            study.set_metric_names(names)


def _key(params: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))


def _best(study: optuna.Study, directions: list[str]) -> tuple[int, list[float]] | None:
    """The best feasible trial so far on the first objective (for the progress line)."""
    sign = 1 if directions[0] == "maximize" else -1
    best = None
    for t in study.get_trials(deepcopy=False, states=[TrialState.COMPLETE]):
        if (
            t.values
            and _feasible(t)
            and (best is None or sign * t.values[0] > sign * best.values[0])
        ):
            best = t
    return (best.number, best.values) if best is not None else None


# Kept for callers of the old private name; use gpuopt.sweeper.record.pick_best.
_pick_best = pick_best


def _mask_config_secrets(config: DictConfig) -> None:
    """Mask storage passwords in the sweep config that Hydra copies into every trial's
    .hydra/hydra.yaml, overrides.yaml and multirun.yaml (interpolations such as
    ${oc.env:GPUOPT_STORAGE} are kept: they hold no secret)."""
    hydra_cfg = config.get("hydra")
    if hydra_cfg is None:
        return
    from omegaconf import read_write

    with read_write(config), read_write(hydra_cfg), open_dict(hydra_cfg):
        _mask_node(hydra_cfg)


def _mask_node(node: Any) -> None:
    from omegaconf import DictConfig as _Dict
    from omegaconf import ListConfig

    keys = node.keys() if isinstance(node, _Dict) else range(len(node))
    for key in keys:
        raw = node._get_node(key)
        if isinstance(raw, (_Dict, ListConfig)):
            _mask_node(raw)
            continue
        value = raw._value() if raw is not None else None
        if isinstance(value, str) and not OmegaConf.is_interpolation(node, key):
            masked = mask_secrets(value)
            if masked != value:
                node[key] = masked
