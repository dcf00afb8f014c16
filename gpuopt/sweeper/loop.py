"""The gpuopt sweep loop, on hydra-optuna-sweeper's machinery.

Reused from the stock plugin: sampler configs, its parser of Hydra sweep syntax into Optuna
distributions, grid handling. Replaced: the loop, because gpuopt needs a baseline trial, failures
told as data (constraints), resume of killed sweeps, a confirmation round, and outputs a user can
act on. The sweeping process never imports torch: the trial engine runs in the launcher's
processes and sends back a picklable `TrialResult`.

`sweep` reads top to bottom: hardware and search space, the study, the baseline, the trials, the
confirmation round, the outputs. Each step's rules live in their own module (search_space,
study, baseline, resume, record, confirm, outputs); settings come from one `SweeperOptions`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from typing import Any

import optuna
from hydra.core.utils import JobReturn
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import Trial, TrialState

from gpuopt.core._compat import (
    heartbeat_thread,
    stock_sweeper_impl,
    storage_of,
    submitit_executor_kind,
    trial_id,
)
from gpuopt.core.secrets import mask_config_secrets
from gpuopt.study import storage as storage_mod
from gpuopt.study.rules import ATTR_BASELINE, same_training_params
from gpuopt.sweeper import (
    baseline,
    interference,
    machine,
    memory_axis,
    outputs,
    profiling,
    resume,
    task,
)
from gpuopt.sweeper import progress as progress_mod
from gpuopt.sweeper import study as study_mod
from gpuopt.sweeper.confirm import rounds
from gpuopt.sweeper.launchers.fresh_process import terminate_as_interrupt
from gpuopt.sweeper.objectives import SweepConfigError, TrialOutcome
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.sweeper.progress import Progress
from gpuopt.sweeper.record import outcome_of, record_trial
from gpuopt.sweeper.space import (
    SearchSpace,
    build_search_space,
    override_text,
    select_device_params,
    suggest,
    validate_overrides,
)

log = logging.getLogger("gpuopt.sweeper")


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
            options.custom_search_space,
            options.params,
        )
        self.options = options
        # self.n_trials (the stock attribute) is the effective count: a grid may lower it.
        # Same grace as the storage's heartbeat check (Optuna's default: 2 x interval).
        grace = options.grace_period or 2 * (options.heartbeat_interval or 0)
        self._ownerless = resume.OwnerlessWatch(grace)
        self._labels_checked = False
        # Grid sweeps whose composed config is one of the grid's points: those params, until the
        # grid reaches that point and the trial is marked baseline (no extra trial).
        self._baseline_point: dict[str, Any] | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        mask_config_secrets(config)  # every trial's .hydra/*.yaml and multirun.yaml copy it
        self._keep_gpus_visible()

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

    # ---- sweep ---------------------------------------------------------------------------------

    def sweep(self, arguments: list[str]) -> None:
        """The sweep; stopped by Ctrl-C, SIGTERM or SIGHUP, it marks its running trials interrupted
        at once (re-queued, as a resume would) and exits with one line, no traceback."""
        self._study: optuna.Study | None = None
        try:
            with terminate_as_interrupt():
                self._sweep(arguments)
        except KeyboardInterrupt as exc:
            resume.exit_interrupted(self._study, str(exc) or "Ctrl-C")

    def _sweep(self, arguments: list[str]) -> None:
        t_start = time.monotonic()
        names, directions = task.objectives(self.options, self.direction)
        task.check_task_config(
            self.options, self.config
        )  # gpuopt's own task: its values, before anything exists
        facts = machine.hardware_facts()
        probe = task.check_task_device(
            self.options, self.config, task.probe_env(self.options, bool(self.params))
        )
        device_type = machine.detect_device_type(task.configured_device(self.config), facts)
        if probe.device_type and task.configured_device(self.config) in (None, "auto"):
            device_type = probe.device_type
        space = self._search_space(arguments, probe, device_type)
        validate_overrides(self.hydra_context.config_loader, self.config, space)

        hw_id = machine.hardware_id(facts)
        url = study_mod.storage_url(self.options.storage, self.config)
        self.storage = url if url is not None else study_mod.MEMORY  # as logs show it
        study, created = study_mod.open_study(
            task.study_name(self.options, self.study_name, self.config, space, hw_id),
            url,
            self.sampler,
            names,
            directions,
            (self.options.heartbeat_interval, self.options.grace_period),
        )
        self._study = study
        if created:
            study_mod.record_new_study(study, names, directions, hw_id, facts, probe, space.dropped)
        else:
            study_mod.warn_other_hardware(study, hw_id)
            study_mod.check_search_space(study, space.distributions)
        names = task.study_metric_names(study, names)
        task.check_sampler(self.sampler, directions)

        to_go = self._trials_to_go(study, space, created)
        progress_mod.log_start(
            study, url, self.sampler, names, directions, self.n_trials - to_go, self.n_trials
        )
        progress = Progress(self.n_trials, names, directions, self.n_trials - to_go, t_start)
        self._run_trials(study, to_go, space, progress)

        def measure(overrides: list[str], job: int) -> TrialOutcome:  # a run, not a trial
            return self._measure(overrides, job, names, directions)

        confirmation = rounds.confirm_if_last(
            study,
            names=names,
            directions=directions,
            top_k=self.options.confirm.top_k,
            rounds=self.options.confirm.rounds,
            max_share=self.options.confirm.max_share,
            target_halfwidth=self.options.confirm.target_halfwidth,
            n_trials=self.n_trials,
            sweep_dir=str(self.config.hydra.sweep.dir),
            measure=measure,
            compose=self._compose if self.options.gpuopt_task else None,
            in_process=self.options.confirm.in_process,
            window_s=self.options.confirm.window_s,
        )
        pending = rounds.elsewhere(
            study, confirmation, directions, self.options.confirm, self.n_trials
        )
        if not pending:  # the best is final here: where its time goes
            profiling.profile_best(study, self.options, directions, confirmation, measure)
        loader = self.hydra_context.config_loader
        identity = task.sweep_identity(
            self.config, loader, self.options, study, url, names, directions
        )
        text = outputs.write_outputs(
            study, identity, confirmation, time.monotonic() - t_start, best_pending=pending
        )
        print(text, flush=True)

    # ---- whose task, which names ---------------------------------------------------------------

    def _trials_to_go(self, study: optuna.Study, space: SearchSpace, created: bool) -> int:
        """Recover dead workers' trials, make sure a baseline will run, fit n_trials to a grid;
        how many trials the study still needs."""
        resume.recover(study, self._ownerless)
        to_go = resume.trials_to_go(study.get_trials(deepcopy=False), self.n_trials)
        if to_go and self.options.baseline:
            self._baseline_point = baseline.prepare(study, self.config, space, created)
        if space.is_grid:
            grid_trials = baseline.grid_trials(space, study.get_trials(deepcopy=False))
            if grid_trials < self.n_trials:
                log.info(
                    "GridSampler: n_trials %d -> %d (the grid's size)", self.n_trials, grid_trials
                )
            self.n_trials = min(self.n_trials, grid_trials)
        return resume.trials_to_go(study.get_trials(deepcopy=False), self.n_trials)

    # ---- configuration -------------------------------------------------------------------------

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
        poor = probe.poor_choices if self.options.device_aware else None
        axis = memory_axis.plan_for_sweep(self.config, self.options, preset, arguments, device_type)
        space = build_search_space(preset, arguments, poor, grid=is_grid, batch_axis=axis)
        if space.grid is not None:
            self.sampler = self.sampler(space.grid)
        return space

    # ---- trials --------------------------------------------------------------------------------

    def _run_trials(
        self,
        study: optuna.Study,
        to_go: int,
        space: SearchSpace,
        progress: Progress,
    ) -> None:
        """Ask, launch, record until the study holds n_trials counted trials.

        The study, not this process, is the source of truth: other workers may share it (a
        PostgreSQL or journal storage), so what is left is re-read before every batch.
        """
        owner = resume.this_owner()
        progress.start(study.get_trials(deepcopy=False))
        first, waiting_logged = True, False
        while True:
            if not first:
                resume.recover(study, self._ownerless)
                to_go = resume.trials_to_go(study.get_trials(deepcopy=False), self.n_trials)
            first = False
            if to_go <= 0:
                # n_trials are taken; trials of other workers may still be running. With heartbeats
                # on, stay until they finish: a worker that died under one has its trial re-queued
                # after grace_period, and this worker runs it.
                if not self._wait_for_others(study, owner, waiting_logged):
                    return
                waiting_logged = True
                continue
            trials, full = self._ask(study, min(self.n_jobs, to_go), owner)
            if not trials:
                return
            self._run_batch(study, trials, space, progress)
            progress.check_failure_rate(
                self.max_failure_rate, study.study_name, storage_mod.display(self.storage)
            )
            if full:
                return

    def _wait_for_others(self, study: optuna.Study, owner: dict, logged: bool) -> bool:
        """Whether to wait (a moment) for other workers' trials; False: this worker is done."""
        others = [
            t
            for t in resume.in_flight(study.get_trials(deepcopy=False))
            if t.system_attrs.get(resume.OWNER_ATTR) != owner
        ]
        if not others or not storage_mod.heartbeat_on(storage_of(study)):
            return False
        if not logged:
            log.info(
                "waiting for %d trial(s) of other workers (re-run here if their worker dies)",
                len(others),
            )
        time.sleep(min(2.0, float(self.options.heartbeat_interval or 2)))
        return True

    def _ask(self, study: optuna.Study, n: int, owner: dict) -> tuple[list[Trial], bool]:
        """Up to n trials this worker may run, and whether the study is full (see resume.py's rule:
        a trial with n_trials counted-or-waiting trials below its number is void, not run)."""
        out: list[Trial] = []
        storage = storage_of(study)
        while len(out) < n:
            with warnings.catch_warnings():
                # "Heartbeat of storage is supposed to be used with Study.optimize": gpuopt runs
                # the heartbeat thread itself, around each launch.
                warnings.simplefilter("ignore")
                trial = study.ask()
            if storage_mod.heartbeat_on(storage):
                # Beat at once: a trial that never beat is invisible to the stale check.
                storage.record_heartbeat(trial_id(trial))
            storage.set_trial_system_attr(trial_id(trial), resume.OWNER_ATTR, owner)
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

    def _run_batch(
        self,
        study: optuna.Study,
        trials: list[Trial],
        space: SearchSpace,
        progress: Progress,
    ) -> None:
        """Launch one batch under heartbeats and record each trial as it is read back."""
        beats = [heartbeat_thread(t, storage_of(study)) for t in trials]
        for beat in beats:
            beat.start()  # records a beat at once, then every heartbeat_interval seconds
        elsewhere = resume.FinishedElsewhere(study, trials)
        if storage_mod.heartbeat_on(storage_of(study)) and hasattr(self.launcher, "stop_check"):
            self.launcher.stop_check = elsewhere.reason  # a paused worker's stale trial: stop it
        try:
            overrides = [self._configure(t, space) for t in trials]
            launched = profiling.launch_overrides(self.options, trials, overrides)
            returns = self._launch(launched, [t.number for t in trials])
            for slot, (trial, trial_overrides, ret) in enumerate(
                zip(trials, overrides, returns, strict=False)
            ):
                if elsewhere.finished(slot) or not self._still_running(study, trial):
                    log.warning(
                        "trial #%d was failed as stale by another worker while this worker sent "
                        "no heartbeat (paused?): its result is dropped, its re-run counts",
                        trial.number,
                    )
                    continue
                outcome = outcome_of(ret, progress.names, progress.directions)
                if trial.user_attrs.get(ATTR_BASELINE) and outcome.failed:
                    baseline.skip(study, trial, trial_overrides, ret, outcome)
                    continue
                self._tell(study, trial, trial_overrides, ret, outcome)
                baseline_trial = bool(trial.user_attrs.get(ATTR_BASELINE))
                log.info(progress.record(trial.number, baseline_trial, outcome))
                if baseline_trial and self.options.seeding:
                    baseline.enqueue_seeds(study, trial, outcome, space, self.n_trials)
        except Exception as exc:
            # The sweep stops (a bad custom_search_space, a storage error): none of its trials
            # may stay RUNNING, or every later run of the study would find them in flight.
            resume.fail_unfinished(study, trials, f"the sweep stopped: {type(exc).__name__}: {exc}")
            raise
        finally:
            if hasattr(self.launcher, "stop_check"):
                self.launcher.stop_check = None
            for beat in beats:
                beat.join()

    @staticmethod
    def _still_running(study: optuna.Study, trial: Trial) -> bool:
        return storage_of(study).get_trial(trial_id(trial)).state == TrialState.RUNNING

    def _configure(self, trial: Trial, space: SearchSpace) -> list[str]:
        """Suggest the trial's params; its overrides. The baseline suggests only the keys it was
        enqueued with (the others keep their configured value)."""
        is_baseline = bool(trial.user_attrs.get(ATTR_BASELINE))
        pinned = baseline.pinned_params(trial) if is_baseline else {}
        for name, dist in space.distributions.items():
            if not is_baseline or name in pinned:
                suggest(trial, name, dist)
        for name, value in space.fixed_params.items():
            trial.set_user_attr(name, value)  # as the stock sweeper does
        point = self._baseline_point
        if point is not None and not is_baseline and baseline.mark_grid_point(trial, point):
            self._baseline_point = None
        if self.custom_search_space_extender and not is_baseline:
            self.custom_search_space_extender(self.config, trial)
        overlap = trial.params.keys() & space.fixed_params.keys()
        if overlap:
            raise SweepConfigError(
                "hydra.sweeper.params", sorted(overlap), "each key either searched or fixed"
            )
        return (
            [override_text(k, v) for k, v in trial.params.items()]
            + [f"{k}={v}" for k, v in space.fixed_params.items()]
            + list(space.fixed_overrides)
        )

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

    def _compose(self, overrides: list[str]) -> Any:
        """A job's config as the launcher composes it (the confirmation's in-process mode)."""
        return self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))

    def _measure(
        self, overrides: list[str], job: int, names: list[str], directions: list[str]
    ) -> TrialOutcome:
        """One confirmation run (not a trial of the study)."""
        return outcome_of(self._launch([overrides], [job])[0], names, directions)

    def _tell(
        self,
        study: optuna.Study,
        trial: Trial,
        overrides: list[str],
        ret: Any,
        outcome: TrialOutcome,
    ) -> None:
        interference.flag_outcome(study, trial, outcome)
        try:
            record_trial(study, trial, overrides, ret, outcome)
        except UpdateFinishedTrialError:  # failed as stale by another worker a moment ago
            log.warning("trial #%d was finished by another worker: not recorded", trial.number)
            return
        if outcome.plain and not outcome.failed and not self._labels_checked:
            self._labels_checked = True  # one study read per sweep, not per trial
            study_mod.relabel_plain_objectives(study, len(outcome.values or []))
