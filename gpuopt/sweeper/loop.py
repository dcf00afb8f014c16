"""The gpuopt sweep loop, on hydra-optuna-sweeper's machinery.

Reused from the stock plugin: sampler configs, its sweep-syntax parser, grid handling. Replaced:
the loop (a baseline trial, failures told as data, resume, a confirmation round, actionable
outputs). The sweeping process never imports torch: trials send back a picklable `TrialResult`."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from gpuopt.core import knobs
from gpuopt.core._compat import launcher_chosen, stock_sweeper_impl, submitit_executor_kind
from gpuopt.core.fmt import duration
from gpuopt.core.lifeline import terminate_as_interrupt
from gpuopt.core.secrets import mask_config_secrets
from gpuopt.study import storage as storage_mod
from gpuopt.study.keys import STUDY_BATCH_RULE
from gpuopt.study.records import Confirmation
from gpuopt.study.rules import same_training_params
from gpuopt.sweeper import (
    baseline,
    global_batch,
    machine,
    memory_axis,
    open_study,
    outputs,
    owners,
    profile_runs,
    record,
    resume,
    task,
)
from gpuopt.sweeper import progress as progress_mod
from gpuopt.sweeper.confirm import rounds
from gpuopt.sweeper.objectives import TrialOutcome
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.sweeper.progress import Progress
from gpuopt.sweeper.race import policy as race_policy
from gpuopt.sweeper.race.runner import RaceRunner
from gpuopt.sweeper.space import (
    SearchSpace,
    build_search_space,
    extender,
    select_device_params,
    validate_overrides,
)
from gpuopt.sweeper.trial_artifacts import TrialFiles
from gpuopt.sweeper.trials import TrialRunner, launch

log = logging.getLogger("gpuopt.sweeper")

TIMING_FILE = (
    "timing.json"  # where the sweep's time went (scripts/bench_time_to_answer.py reads it)
)
FRESH = "fresh_process"  # the ConfigStore name (gpuopt.sweeper.launchers.fresh_process)


@dataclass
class PhaseClock:
    """Wall time per phase, in the order the sweep runs them (plan, trials, confirmation, ...)."""

    t0: float = field(default_factory=time.monotonic)
    phases: dict[str, float] = field(default_factory=dict)

    def lap(self, phase: str) -> None:
        """The time since the previous lap (or the start) is `phase`'s."""
        self.phases[phase] = (
            self.phases.get(phase, 0.0) + self.elapsed() - sum(self.phases.values())
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def write(self, sweep_dir: Path, raced: bool) -> None:
        """timing.json ({"<phase>_s": s, "total_s": s, "raced": bool}) and one log line."""
        record = {f"{k}_s": round(v, 3) for k, v in self.phases.items()}
        record.update(total_s=round(self.elapsed(), 3), raced=raced)
        try:
            (sweep_dir / TIMING_FILE).write_text(json.dumps(record, indent=1) + "\n")
        except OSError as exc:
            log.warning("%s not written: %s", TIMING_FILE, exc)
        shown = ", ".join(f"{k} {duration(v)}" for k, v in self.phases.items())
        log.info("time: %s (%s)", shown, "raced in one process" if raced else "fresh processes")


class GpuoptSweeperImpl(stock_sweeper_impl()):  # type: ignore[misc]
    def __init__(self, sampler: Any, options: SweeperOptions) -> None:
        super().__init__(
            sampler,
            options.direction,
            options.storage,
            options.study_name,
            options.n_trials,
            options.n_jobs,
            options.max_failure_rate,
            None,  # custom_search_space: instantiated in setup, under the app's whitelist
            options.params,
        )
        self.options = options
        # self.n_trials (the stock attribute) is the effective count: a grid may lower it.
        # Same grace as the storage's heartbeat check (Optuna's default: 2 x interval).
        grace = options.grace_period or 2 * (options.heartbeat_interval or 0)
        self._recovery = resume.Recovery(grace, (options.heartbeat_interval or 0) / 2)

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        if self._wants_fresh_process(hydra_context.config_loader, config):
            _use_fresh_process(config)
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self._own_task = race_policy.is_gpuopt_main(task_function)
        trust = config.get("trust") if self.options.gpuopt_task else None
        self.custom_search_space_extender = extender(
            self.options.custom_search_space, task_function, list(trust or [])
        )
        mask_config_secrets(config)  # every trial's .hydra/*.yaml and multirun.yaml copy it
        self._keep_gpus_visible()

    def _wants_fresh_process(self, config_loader: Any, config: DictConfig) -> bool:
        """Whether an app gpuopt measures, left on Hydra's default `basic` launcher, gets gpuopt's
        fresh processes: in one long-lived process settings read 10-35% faster (warm caches,
        allocator), so later trials look faster than the baseline. An app that chose keeps its own."""
        choices = config.hydra.runtime.choices or {}
        if not self.options.measured or choices.get("hydra/launcher") != "basic":
            return False
        try:
            return not launcher_chosen(config_loader, config)
        except Exception as exc:  # a Hydra whose defaults list reads differently: keep the app's
            log.warning(
                "launcher: keeping hydra/launcher=basic (could not tell who chose it: %s)", exc
            )
            return False

    def _keep_gpus_visible(self) -> None:
        """submitit's local launcher hides every GPU unless told which: give trials ours."""
        params = getattr(self.launcher, "params", None)
        if submitit_executor_kind(self.launcher) != "local" or not isinstance(params, dict):
            return
        if hasattr(self.launcher, "_device_plan"):
            return  # gpuopt's fresh_process launcher sets each job's GPUs itself
        if params.get("gpus_per_node") is not None or params.get("setup"):
            return  # the user chose
        params["setup"] = [machine.gpu_setup_command(dict(os.environ))]

    # ---- the sweep, top to bottom --------------------------------------------------------------

    def sweep(self, arguments: list[str]) -> None:
        """The sweep; stopped by Ctrl-C, SIGTERM or SIGHUP, it marks its running trials
        interrupted and exits with one line, no traceback."""
        self._study: optuna.Study | None = None
        try:
            with terminate_as_interrupt():
                self._sweep(arguments)
        except KeyboardInterrupt as exc:
            resume.exit_interrupted(self._study, str(exc) or "Ctrl-C")

    def _sweep(self, arguments: list[str]) -> None:
        """Plan, open the study, run its trials, confirm the best, write the outputs."""
        clock = PhaseClock()
        names, directions = task.objectives(self.options, self.direction)
        facts, probe, space = self._plan(arguments)
        names = task.device_objectives(self.options, names, probe.data)  # util.gpu or SM activity
        rule = global_batch.for_sweep(  # which configurations hold the global batch (answer a)
            self.options.batch_keys,
            self.options.gpuopt_task,
            self.config,
            space.fixed_params,
            list(space.distributions),
        )
        study, url, created = self._open_study(names, directions, facts, probe, space)
        record.study_attrs(study, {STUDY_BATCH_RULE: None if rule is None else rule.to_attr()})
        names = task.study_metric_names(study, names)
        # an app whose objective is its own value returns plain values: no files to keep
        self._files = (
            TrialFiles.for_study(self.options.artifacts, self.storage, study)
            if self.options.measured
            else None
        )
        task.check_sampler(self.sampler, directions)

        to_go, baseline_point = self._trials_to_go(study, space, created)
        progress_mod.log_start(
            study, url, self.sampler, names, directions, self.n_trials - to_go, self.n_trials
        )
        progress = Progress(self.n_trials, names, directions, clock.t0)
        race = self._race_runner(study, space, names[0], baseline_point)
        clock.lap("plan")
        (race or self._runner(baseline_point)).run(study, to_go, space, progress)
        clock.lap("trials")

        if race is not None and race.process is not None:
            # Not reused for the confirmation: after whole (profiled) trials, this process's
            # windows read a pair 6.8% apart from fresh processes, a new one's -2.8%
            # (scripts/bench_race_bias.py, docs/benchmarks.md)
            race.process.close()
        measure = functools.partial(self._measure, names=names, directions=directions)
        confirmation = self._confirm(study, names, directions, measure)
        clock.lap("confirmation")
        pending = rounds.elsewhere(
            study, confirmation, directions, self.options.confirm, self.n_trials
        )
        if not pending:  # the best is final here: where its time goes
            profile_runs.profile_best(study, self.options, directions, confirmation, measure)
            if self._files is not None:
                self._files.upload_best_trace(study)
        clock.lap("profile")
        loader = self.hydra_context.config_loader
        identity = task.sweep_identity(
            self.config, loader, self.options, study, url, names, directions
        )
        text = outputs.write_outputs(
            study, identity, confirmation, clock.elapsed(), best_pending=pending
        )
        clock.write(identity.sweep_dir, raced=race is not None)
        print(text, flush=True)

    # ---- the steps -----------------------------------------------------------------------------

    def _plan(self, arguments: list[str]) -> tuple[dict[str, Any], machine.EnvProbe, SearchSpace]:
        """The machine's facts, the env probe and the search space, after gpuopt's own task is
        checked. The storage is checked before the machine is probed: a refused login is the first line."""
        open_study.check_storage(self.options.storage, self.config)
        facts = machine.hardware_facts()
        task.check_values(self.options, self.config)
        probe = task.check_task(
            self.options, self.config, task.probe_env(self.options, self.params)
        )
        device_type = machine.detect_device_type(task.configured_device(self.config), facts)
        if probe.device_type and task.configured_device(self.config) in (None, "auto"):
            device_type = probe.device_type
        space = self._search_space(arguments, probe, device_type)
        validate_overrides(self.hydra_context.config_loader, self.config, space)
        return facts, probe, space

    def _search_space(
        self, arguments: list[str], probe: machine.EnvProbe, device_type: str
    ) -> SearchSpace:
        preset = {str(k): str(v) for k, v in (self.params or {}).items()}
        preset = same_training_params(preset, self.config)  # the baseline's batch (issue 13)
        extra = select_device_params(self.options.device_params, device_type)
        preset.update({k: v for k, v in extra.items() if k not in preset})
        # The stock grid config is a partial, given the grid once the space is known.
        is_grid = (
            isinstance(self.sampler, functools.partial)
            and self.sampler.func == optuna.samplers.GridSampler
        )
        aware = self.options.device_aware and probe.data  # the knob catalogue's rules, its facts
        judge = functools.partial(knobs.judge, facts=probe.data) if aware else None
        probe_dir = Path(str(self.config.hydra.sweep.dir)) / ".gpuopt"
        axis = memory_axis.plan_batch_axis(
            self.config, preset, arguments, device_type, self.options, probe_dir
        )
        space = build_search_space(preset, arguments, judge, grid=is_grid, batch_axis=axis)
        if space.grid is not None:
            self.sampler = self.sampler(space.grid)
        return space

    def _open_study(
        self,
        names: list[str],
        directions: list[str],
        facts: dict[str, Any],
        probe: machine.EnvProbe,
        space: SearchSpace,
    ) -> tuple[optuna.Study, str | None, bool]:
        """(the study, its storage URL, whether this worker created it)."""
        hw_id = machine.hardware_id(facts)
        url = open_study.storage_url(self.options.storage, self.config)
        self.storage = url if url is not None else open_study.MEMORY  # as logs show it
        study, created = open_study.open_study(
            task.study_name(self.options, self.study_name, self.config, space, hw_id),
            url,
            self.sampler,
            names,
            directions,
            (self.options.heartbeat_interval, self.options.grace_period),
            hw_id,
            facts,
            probe,
            space,
        )
        self._study = study
        return study, url, created

    def _runner(self, baseline_point: dict[str, Any] | None) -> TrialRunner:
        """This worker's trials, with the n_trials this study ends at."""
        return TrialRunner(
            launcher=self.launcher,
            options=self.options,
            config=self.config,
            n_trials=self.n_trials,
            storage_text=storage_mod.display(self.storage),
            recovery=self._recovery,
            extender=self.custom_search_space_extender,
            baseline_point=baseline_point,
            files=self._files,
        )

    def _race_runner(
        self,
        study: optuna.Study,
        space: SearchSpace,
        objective: str,
        baseline_point: dict[str, Any] | None,
    ) -> RaceRunner | None:
        """The race's runner when this sweep can race (sweeper/race/), else None (logged why)."""
        finished = race_policy.measured_apart(study.get_trials(deepcopy=False))
        composed = race_policy.task_config(self.config)
        why = race_policy.why_not(self.options, self.launcher, composed, space, objective, finished)
        if why is None and not getattr(self, "_own_task", False):
            why = "the app's own task function (the race measures with gpuopt's engines)"
        if why is not None:
            if self.options.gpuopt_task and self.options.race.enabled:
                log.info("trials in fresh processes, one each (no race: %s)", why)
            return None
        log.info(
            "race: the trials in one process: the baseline, then each candidate in %d windows "
            "of %g s, each between two baseline windows, %d per screen; each screen's best %d "
            "at %gx the baseline or faster read over it again and measured as whole trials, "
            "the others pruned",
            self.options.race.slices,
            self.options.race.window_s,
            self.options.race.screen,
            self.options.race.finalists,
            self.options.race.floor,
        )
        return RaceRunner(
            self._runner(baseline_point),
            compose=self._compose,
            objective=objective,
            directory=Path(str(self.config.hydra.sweep.dir)) / "race",
        )

    def _trials_to_go(
        self, study: optuna.Study, space: SearchSpace, created: bool
    ) -> tuple[int, dict[str, Any] | None]:
        """Recover dead workers' trials, prepare the baseline, fit n_trials to a grid; trials
        still to go, and the grid point to mark baseline (if any)."""
        self._recovery.recover(study)
        to_go = owners.trials_to_go(study.get_trials(deepcopy=False), self.n_trials)
        point = None
        if to_go and self.options.baseline:
            point = baseline.prepare(study, self.config, space, created)
        if space.is_grid:
            grid_trials = baseline.grid_trials(space, study.get_trials(deepcopy=False))
            if grid_trials < self.n_trials:
                log.info(
                    "GridSampler: n_trials %d -> %d (the grid's size)", self.n_trials, grid_trials
                )
            self.n_trials = min(self.n_trials, grid_trials)
        return owners.trials_to_go(study.get_trials(deepcopy=False), self.n_trials), point

    def _confirm(
        self, study: optuna.Study, names: list[str], directions: list[str], measure: Any
    ) -> Confirmation | None:
        """The confirmation round, in the last worker to finish. In-process only for gpuopt's own
        task function (its engine is built from the composed configs)."""
        own = self.options.gpuopt_task and getattr(self, "_own_task", False)
        return rounds.confirm_if_last(
            study,
            self.options.confirm,
            names=names,
            directions=directions,
            n_trials=self.n_trials,
            sweep_dir=str(self.config.hydra.sweep.dir),
            measure=measure,
            compose=self._compose if own else None,
            app_config=OmegaConf.to_container(self.config, resolve=False),
        )

    # ---- runs outside the study (confirmation, the best's profile) -----------------------------

    def _compose(self, overrides: list[str]) -> Any:
        """A job's config as the launcher composes it (the confirmation's in-process mode)."""
        return self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))

    def _measure(
        self, overrides: list[str], job: int, names: list[str], directions: list[str]
    ) -> TrialOutcome:
        """One confirmation run (not a trial of the study)."""
        return record.outcome_of(launch(self.launcher, [overrides], [job])[0], names, directions)


def _use_fresh_process(config: DictConfig) -> None:
    """The sweep's master config selects gpuopt's fresh-process launcher, as
    `hydra/launcher=fresh_process` on the command line would (every trial's config has it)."""
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
