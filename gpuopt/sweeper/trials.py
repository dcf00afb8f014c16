"""One worker's trials of a study: ask, launch, record, until the study holds n_trials.

The study, not this process, is the source of truth: other workers may share it (a PostgreSQL or
journal storage), so what is left is re-read before every batch, and a trial is asked under
resume.py's counting rule (a trial with n_trials counted-or-waiting trials below its number is
void, not run). Each batch runs under Optuna's heartbeats; each trial is recorded as its job is
read back: a baseline whose task raised is skipped (the study goes on without one; one the
launcher failed is a failed trial), a measured one enqueues the expert seeds.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from hydra.core.utils import JobReturn
from omegaconf import DictConfig
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import Trial, TrialState

from gpuopt.core._compat import heartbeat_thread, storage_of, trial_id
from gpuopt.study import storage as storage_mod
from gpuopt.study.keys import ATTR_BASELINE, ATTR_OWNER
from gpuopt.sweeper import baseline, interference, profiling, resume
from gpuopt.sweeper.artifacts import TrialFiles
from gpuopt.sweeper.objectives import TrialOutcome
from gpuopt.sweeper.open_study import relabel_plain_objectives
from gpuopt.sweeper.options import SweepConfigError, SweeperOptions
from gpuopt.sweeper.progress import Progress
from gpuopt.sweeper.record import outcome_of, record_trial
from gpuopt.sweeper.space import SearchSpace, override_text, suggest

log = logging.getLogger("gpuopt.sweeper")


@dataclass
class TrialRunner:
    """What one worker needs to run its share of a study's trials (`run`)."""

    launcher: Any  # the Hydra launcher the sweeper set up
    options: SweeperOptions
    config: DictConfig  # the composed config (the custom search space extender reads it)
    n_trials: int  # the study's total (a grid may have lowered hydra.sweeper.n_trials)
    storage_text: str  # the storage as logs show it
    ownerless: resume.OwnerlessWatch
    extender: Callable[[DictConfig, Trial], None] | None = None  # hydra.sweeper.custom_search_space
    # Grid sweeps whose composed config is one of the grid's points: those params, until the grid
    # reaches that point and the trial is marked baseline (no extra trial).
    baseline_point: dict[str, Any] | None = None
    labels_checked: bool = False  # plain values relabelled once per sweep, not per trial
    files: TrialFiles | None = None  # the artifact store each trial's files go to (artifacts.py)

    def run(self, study: optuna.Study, to_go: int, space: SearchSpace, progress: Progress) -> None:
        """Ask, launch, record until the study holds n_trials counted trials."""
        progress.start(study.get_trials(deepcopy=False))
        first, waiting_logged = True, False
        while True:
            if not first:
                resume.recover(study, self.ownerless)
                to_go = resume.trials_to_go(study.get_trials(deepcopy=False), self.n_trials)
            first = False
            if to_go <= 0:
                # n_trials are taken; trials of other workers may still be running. With heartbeats
                # on, stay until they finish: a worker that died under one has its trial re-queued
                # after grace_period, and this worker runs it.
                if not self._wait_for_others(study, waiting_logged):
                    return
                waiting_logged = True
                continue
            trials, full = self._ask(study, min(self.options.n_jobs, to_go))
            if not trials:
                return
            self._run_batch(study, trials, space, progress)
            progress.check_failure_rate(
                self.options.max_failure_rate, study.study_name, self.storage_text
            )
            if full:
                return

    def _wait_for_others(self, study: optuna.Study, logged: bool) -> bool:
        """Whether to wait (a moment) for other workers' trials; False: this worker is done."""
        others = resume.running_elsewhere(study.get_trials(deepcopy=False))
        if not others or not storage_mod.heartbeat_on(storage_of(study)):
            return False
        if not logged:
            log.info(
                "waiting for %d trial(s) of other workers (re-run here if their worker dies)",
                len(others),
            )
        time.sleep(min(2.0, float(self.options.heartbeat_interval or 2)))
        return True

    def _ask(self, study: optuna.Study, n: int) -> tuple[list[Trial], bool]:
        """Up to n trials this worker may run, and whether the study is full (see resume.py's rule:
        a trial with n_trials counted-or-waiting trials below its number is void, not run)."""
        out: list[Trial] = []
        storage, owner = storage_of(study), resume.this_owner()
        while len(out) < n:
            with warnings.catch_warnings():
                # "Heartbeat of storage is supposed to be used with Study.optimize": gpuopt runs
                # the heartbeat thread itself, around each launch.
                warnings.simplefilter("ignore")
                trial = study.ask()
            if storage_mod.heartbeat_on(storage):
                # Beat at once: a trial that never beat is invisible to the stale check.
                storage.record_heartbeat(trial_id(trial))
            storage.set_trial_system_attr(trial_id(trial), ATTR_OWNER, owner)
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
        self, study: optuna.Study, trials: list[Trial], space: SearchSpace, progress: Progress
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
            returns = launch(self.launcher, launched, [t.number for t in trials])
            for slot, (trial, trial_overrides, ret) in enumerate(
                zip(trials, overrides, returns, strict=False)
            ):
                if elsewhere.finished(slot) or not still_running(study, trial):
                    log.warning(
                        "trial #%d was failed as stale by another worker while this worker sent "
                        "no heartbeat (paused?): its result is dropped, its re-run counts",
                        trial.number,
                    )
                    continue
                self._record(study, trial, trial_overrides, ret, space, progress)
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

    def _record(
        self,
        study: optuna.Study,
        trial: Trial,
        overrides: list[str],
        ret: Any,
        space: SearchSpace,
        progress: Progress,
    ) -> None:
        """One trial read back: told to the study (a failed baseline skipped), its progress line,
        and after a measured baseline the expert seeds."""
        outcome = outcome_of(ret, progress.names, progress.directions)
        is_baseline = bool(trial.user_attrs.get(ATTR_BASELINE))
        if is_baseline and outcome.failed and not baseline.launcher_failed(ret):
            baseline.skip(study, trial, overrides, ret, outcome)
            return
        self._tell(study, trial, overrides, ret, outcome)
        diagnostics = getattr(ret, "gpuopt_diagnostics", None)  # gpuopt's launchers' traceback
        line = progress.record(
            trial.number,
            is_baseline,
            outcome,
            study.get_trials(deepcopy=False),  # the study's count, pace and best (all workers)
            getattr(diagnostics, "traceback", None),
        )
        log.info(line)
        if is_baseline and self.options.seeding:
            baseline.enqueue_seeds(study, trial, outcome, space, self.n_trials)

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
        point = self.baseline_point
        if point is not None and not is_baseline and baseline.mark_grid_point(trial, point):
            self.baseline_point = None
        if self.extender and not is_baseline:
            self.extender(self.config, trial)
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

    def _tell(
        self,
        study: optuna.Study,
        trial: Trial,
        overrides: list[str],
        ret: Any,
        outcome: TrialOutcome,
    ) -> None:
        interference.flag_outcome(study, trial, outcome)
        if self.files is not None:  # before the tell: a finished trial takes no artifact
            self.files.upload_trial(study, trial, ret, outcome)
        try:
            record_trial(study, trial, overrides, ret, outcome)
        except UpdateFinishedTrialError:  # failed as stale by another worker a moment ago
            log.warning("trial #%d was finished by another worker: not recorded", trial.number)
            return
        if outcome.plain and not outcome.failed and not self.labels_checked:
            self.labels_checked = True  # one study read per sweep, not per trial
            relabel_plain_objectives(study, len(outcome.values or []))


def still_running(study: optuna.Study, trial: Trial) -> bool:
    """Whether the storage still holds `trial` RUNNING (no other worker finished it meanwhile)."""
    return storage_of(study).get_trial(trial_id(trial)).state == TrialState.RUNNING


def launch(
    launcher: Any, overrides: list[list[str]], numbers: list[int]
) -> list[JobReturn | BaseException]:
    """Launch a batch; a launcher that raises does not end the sweep (jobs retried one by one)."""
    try:
        returns = list(launcher.launch(overrides, initial_job_idx=numbers[0]))
        if len(returns) == len(overrides):
            return returns
        raise RuntimeError(f"launcher returned {len(returns)} results for {len(overrides)} jobs")
    except Exception as exc:
        if len(overrides) == 1:
            log.warning("launcher failed: %s: %s", type(exc).__name__, exc)
            return [exc]
        log.warning("launcher failed for a batch (%s); launching its jobs one by one", exc)
        return [launch(launcher, [o], [n])[0] for o, n in zip(overrides, numbers, strict=False)]
