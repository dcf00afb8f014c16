"""One worker's trials of a study: ask, launch, record, until the study holds n_trials.

The study, not this process, is the source of truth (other workers may share it): what is left is
re-read before every batch, and trials are asked under owners.py's counting rule. The study is read
(`get_trials`, a few ms each on SQLite) only where it must be fresh (after a launch, after each
tell) and that snapshot is passed on; anew only where a snapshot could be wrong (after waiting,
after recovery, after an ask it cannot decide). A batch of n_jobs trials reads it n_jobs + 2 times
(tests/test_lifecycle.py counts them)."""

from __future__ import annotations

import datetime as dt
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from hydra.core.utils import JobReturn
from omegaconf import DictConfig
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, Trial, TrialState

from gpuopt.core._compat import (
    set_system_attr_and_beat,
    storage_of,
    trial_id,
)
from gpuopt.core.errors import SweepConfigError
from gpuopt.study import storage as storage_mod
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_INTERFERENCE,
    ATTR_OWNER,
    ATTR_REPLICATE_OF,
    ATTR_WARNINGS,
)
from gpuopt.sweeper import baseline, owners, profile_runs, record, repeats, resume
from gpuopt.sweeper.objectives import TrialOutcome
from gpuopt.sweeper.open_study import relabel_plain_objectives
from gpuopt.sweeper.options import SweeperOptions
from gpuopt.sweeper.progress import Progress
from gpuopt.sweeper.record import outcome_of, record_trial
from gpuopt.sweeper.space import SearchSpace, override_text, suggest
from gpuopt.sweeper.trial_artifacts import TrialFiles

log = logging.getLogger("gpuopt.sweeper")


@dataclass
class TrialRunner:
    """What one worker needs to run its share of a study's trials (`run`)."""

    launcher: Any  # the Hydra launcher the sweeper set up
    options: SweeperOptions
    config: DictConfig  # the composed config (the custom search space extender reads it)
    n_trials: int  # the study's total (a grid may have lowered hydra.sweeper.n_trials)
    storage_text: str  # the storage as logs show it
    recovery: resume.Recovery  # dead workers' trials failed and re-queued, on this worker's clock
    extender: Callable[[DictConfig, Trial], None] | None = None  # hydra.sweeper.custom_search_space
    # Grid sweeps whose composed config is one of the grid's points: those params, until the grid
    # reaches that point and the trial is marked baseline (no extra trial).
    baseline_point: dict[str, Any] | None = None
    labels_checked: bool = False  # plain values relabelled once per sweep, not per trial
    files: TrialFiles | None = None  # the artifact store each trial's files go to (artifacts.py)
    # Each trial's overrides once its params are suggested (at its ask: `_no_blind_repeat`), so
    # that the launch (or the race's screen) calls no custom_search_space function a second time.
    configured: dict[int, list[str]] = field(default_factory=dict)

    def run(
        self,
        study: optuna.Study,
        to_go: int,
        space: SearchSpace,
        progress: Progress,
        batch: Callable[..., list[FrozenTrial] | None] | None = None,
        size: int | None = None,
    ) -> None:
        """Ask, launch, record until the study holds n_trials counted trials (where the study is
        read: the module docstring). `batch` runs each `size` asked trials instead of a launch of
        n_jobs (the race's rounds)."""
        trials: list[FrozenTrial] | None = study.get_trials(deepcopy=False)
        if progress.done_at_start is None:  # the race started it before its baseline
            progress.start(trials)
        first, waiting_logged = True, False
        while True:
            if not first:
                if trials is None:
                    trials = study.get_trials(deepcopy=False)
                if self.recovery.recover(study, trials):
                    trials = study.get_trials(deepcopy=False)  # failed and re-queued some
                to_go = owners.trials_to_go(trials, self.n_trials)
            first = False
            if to_go <= 0:
                # n_trials are taken; trials of other workers may still be running. With heartbeats
                # on, stay until they finish: a worker that died under one has its trial re-queued
                # after grace_period, and this worker runs it.
                if not self._wait_for_others(study, waiting_logged, trials):
                    return
                waiting_logged, trials = True, None  # it waited: the study is read anew
                continue
            asked, full = self.ask(study, min(size or self.options.n_jobs, to_go), trials, space)
            if not asked:
                return
            trials = (batch or self._run_batch)(study, asked, space, progress)
            progress.check_failure_rate(
                self.options.max_failure_rate, study.study_name, self.storage_text
            )
            if full:
                return

    def _wait_for_others(
        self, study: optuna.Study, logged: bool, trials: list[FrozenTrial] | None = None
    ) -> bool:
        """Whether to wait (a moment) for other workers' trials; False: this worker is done."""
        if trials is None:
            trials = study.get_trials(deepcopy=False)
        others = owners.running_elsewhere(trials)
        if not others or not storage_mod.heartbeat_on(storage_of(study)):
            return False
        if not logged:
            log.info(
                "waiting for %d trial(s) of other workers (re-run here if their worker dies)",
                len(others),
            )
        time.sleep(min(2.0, float(self.options.heartbeat_interval or 2)))
        return True

    def ask(
        self,
        study: optuna.Study,
        n: int,
        trials: list[FrozenTrial] | None = None,
        space: SearchSpace | None = None,
    ) -> tuple[list[Trial], bool]:
        """Up to n trials this worker may run, and whether the study is full (owners.is_surplus).
        With the `space`, params are suggested here (`_no_blind_repeat`)."""
        out: list[Trial] = []
        storage, owner = storage_of(study), owners.this_owner()
        while len(out) < n:
            with warnings.catch_warnings():
                # "Heartbeat of storage is supposed to be used with Study.optimize": gpuopt runs
                # the heartbeat thread itself, around each launch.
                warnings.simplefilter("ignore")
                trial = study.ask()
            own_and_beat(storage, trial_id(trial), owner)
            trials = self._counting(study, trial, trials)
            if owners.is_surplus(trial.number, trials, self.n_trials):
                resume.void(study, trial, f"surplus: other workers hold n_trials={self.n_trials}")
                log.info("trial #%d not run: the study's n_trials are taken", trial.number)
                return out, True
            if trial.user_attrs.get(ATTR_BASELINE) and owners.duplicate_baseline(
                trial.number, trials
            ):
                resume.void(study, trial, "duplicate baseline (enqueued by two workers at once)")
                continue
            if space is not None:
                self._no_blind_repeat(study, trial, trials, out, space)
            out.append(trial)
        return out, False

    def _no_blind_repeat(
        self,
        study: optuna.Study,
        trial: Trial,
        trials: list[FrozenTrial],
        asked: list[Trial],
        space: SearchSpace,
    ) -> None:
        """Suggest `trial`'s params now, through a sampler that draws no configuration the study
        holds while one is left unmeasured (sweeper/repeats.py); a repeat that still runs is marked a
        replicate of the first. Not for the baseline, a grid or an app gpuopt does not measure."""
        if trial.user_attrs.get(ATTR_BASELINE) or space.is_grid or not self.options.measured:
            return
        if self.extender is None:
            repeats.install(study, space.distributions)
        try:
            self.configure(trial, space)
        except Exception as exc:  # a bad custom_search_space: none of these may stay RUNNING
            reason = f"the sweep stopped: {type(exc).__name__}: {exc}"
            resume.fail_unfinished(study, [*asked, trial], reason)
            raise
        first = repeats.replicate_of(trial, repeats.taken(trials, asked))
        if first is not None:
            record.trial_attrs(study, trial, {ATTR_REPLICATE_OF: first})
            log.info(
                "trial #%d repeats #%d's configuration (none unmeasured is left, or it was "
                "enqueued): measured as its replicate, the readings pooled",
                trial.number,
                first,
            )

    def _counting(
        self, study: optuna.Study, trial: Trial, before: list[FrozenTrial] | None
    ) -> list[FrozenTrial]:
        """The study's trials the counting rule judges the just-asked `trial` against: read now,
        unless the snapshot before the ask holds every lower-numbered trial and finds it not surplus
        (since then, trials ahead can only stop counting). A surplus or baseline verdict is read anew."""
        if (
            before is not None
            and trial.number <= len(before)
            and not trial.user_attrs.get(ATTR_BASELINE)
            and not owners.is_surplus(trial.number, before, self.n_trials)
        ):
            return before
        return study.get_trials(deepcopy=False)

    def _run_batch(
        self, study: optuna.Study, trials: list[Trial], space: SearchSpace, progress: Progress
    ) -> list[FrozenTrial] | None:
        """Launch one batch under heartbeats and record each trial as it is read back; the study's
        trials as read after the last record (None: not read since a trial was dropped). A trial failed
        as stale elsewhere later still makes its tell raise UpdateFinishedTrialError (`_tell`)."""
        if storage_mod.heartbeat_on(storage_of(study)) and hasattr(self.launcher, "stop_check"):
            # a paused worker's trial failed as stale elsewhere meanwhile: its process is stopped
            self.launcher.stop_check = resume.FinishedElsewhere(study, trials).reason
        with resume.beating(study, trials):
            try:
                overrides = [self.configure(t, space) for t in trials]
                launched = profile_runs.launch_overrides(self.options, trials, overrides)
                returns = launch(self.launcher, launched, [t.number for t in trials])
            finally:
                if hasattr(self.launcher, "stop_check"):
                    self.launcher.stop_check = None
            snapshot: list[FrozenTrial] | None = study.get_trials(deepcopy=False)
            for trial, trial_overrides, ret in zip(trials, overrides, returns, strict=False):
                now = snapshot if snapshot is not None else study.get_trials(deepcopy=False)
                frozen = owners.frozen_of(now, trial.number)
                if frozen is None or frozen.state != TrialState.RUNNING:  # read after the launch
                    log.warning(
                        "trial #%d was failed as stale by another worker while this worker sent "
                        "no heartbeat (paused?): its result is dropped, its re-run counts",
                        trial.number,
                    )
                    snapshot = None
                    continue
                snapshot = self.record(study, trial, trial_overrides, ret, space, progress, now)
        return snapshot

    def record(
        self,
        study: optuna.Study,
        trial: Trial,
        overrides: list[str],
        ret: Any,
        space: SearchSpace,
        progress: Progress,
        trials: list[FrozenTrial] | None = None,
    ) -> list[FrozenTrial] | None:
        """One trial read back: told (a failed baseline skipped), its progress line, and after a
        measured baseline the expert seeds; the study's trials as read after the tell (None: not read)."""
        outcome = outcome_of(ret, progress.names, progress.directions)
        is_baseline = bool(trial.user_attrs.get(ATTR_BASELINE))
        if is_baseline and outcome.failed and not baseline.launcher_failed(ret):
            baseline.skip(study, trial, overrides, ret, outcome)
            return None
        self._tell(study, trial, overrides, ret, outcome, trials)
        # Read after the tell: the study's count, pace and best (all workers' trials up to now).
        after = study.get_trials(deepcopy=False)
        diagnostics = getattr(ret, "gpuopt_diagnostics", None)  # gpuopt's launchers' traceback
        line = progress.record(
            trial.number, is_baseline, outcome, after, getattr(diagnostics, "traceback", None)
        )
        log.info(line)
        if is_baseline and self.options.seeding:
            baseline.enqueue_seeds(study, trial, outcome, space, self.n_trials)
        return after

    def configure(self, trial: Trial, space: SearchSpace) -> list[str]:
        """Suggest the trial's params once; its overrides. The baseline suggests only the keys it
        was enqueued with."""
        if trial.number in self.configured:
            return self.configured[trial.number]
        is_baseline = bool(trial.user_attrs.get(ATTR_BASELINE))
        pinned = baseline.pinned_params(trial) if is_baseline else {}
        for name, dist in space.distributions.items():
            if not is_baseline or name in pinned:
                suggest(trial, name, dist)
        record.trial_attrs(trial.study, trial, space.fixed_params)  # as the stock sweeper does
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
        self.configured[trial.number] = (
            [override_text(k, v) for k, v in trial.params.items()]
            + [f"{k}={v}" for k, v in space.fixed_params.items()]
            + list(space.fixed_overrides)
        )
        return self.configured[trial.number]

    def _tell(
        self,
        study: optuna.Study,
        trial: Trial,
        overrides: list[str],
        ret: Any,
        outcome: TrialOutcome,
        trials: list[FrozenTrial] | None = None,
    ) -> None:
        flag_interference(study, trial, outcome, trials)
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


def own_and_beat(storage: Any, trial_id_: int, owner: dict[str, Any]) -> None:
    """A just-asked trial's owner record and, with heartbeats on, its first beat at once (a trial
    that never beat is invisible to the stale check)."""
    if not storage_mod.heartbeat_on(storage):
        record.trial_system_attr(storage, trial_id_, ATTR_OWNER, owner)
    elif not set_system_attr_and_beat(storage, trial_id_, ATTR_OWNER, owner):
        storage.record_heartbeat(trial_id_)  # a storage with heartbeats but no RDB transaction
        record.trial_system_attr(storage, trial_id_, ATTR_OWNER, owner)


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


# ---- interference -------------------------------------------------------------------------------
# Several workers measuring on one host compete for cores, memory bandwidth and GPUs: every
# throughput they report is wrong (a baseline read 87 samples/s under three workers against ~6,000
# alone). A trial that overlapped in time with another worker's on the same host is flagged (user
# attr, warning, summary note). One worker's own batch (n_jobs > 1) is not: its jobs get separate GPUs.


def _interval(trial: Any, now: dt.datetime) -> tuple[dt.datetime, dt.datetime] | None:
    if trial.datetime_start is None or trial.state == TrialState.WAITING:
        return None
    end = trial.datetime_complete or (now if trial.state == TrialState.RUNNING else None)
    return (trial.datetime_start, end) if end is not None else None


def overlapping(trial: Any, trials: Sequence[Any], now: dt.datetime) -> list[int]:
    """Numbers of the trials of other workers on `trial`'s host whose run overlapped with it
    (`trial` is still running: it ends `now`)."""
    owner = trial.system_attrs.get(ATTR_OWNER) or {}
    span = _interval(trial, now)
    if not owner.get("host") or span is None:
        return []
    found = []
    for other in trials:
        other_owner = other.system_attrs.get(ATTR_OWNER) or {}
        if (
            other.number == trial.number
            or other_owner.get("host") != owner["host"]
            or other_owner.get("pid") == owner.get("pid")
        ):
            continue
        if other.state == TrialState.RUNNING and owners.owner_alive(other_owner) is False:
            continue  # a dead sweep's trial, not yet recovered: it does not run now
        other_span = _interval(other, now)
        if other_span is not None and other_span[0] < span[1] and span[0] < other_span[1]:
            found.append(other.number)
    return found


def flag_interference(
    study: Any, trial: Any, outcome: TrialOutcome, trials: Sequence[Any] | None = None
) -> None:
    """Other workers' trials ran on this host at the same time as `trial`: say so in the outcome
    and the log. `trials`: the study's trials read after the run (None: read here)."""
    if trials is None:
        trials = study.get_trials(deepcopy=False)
    frozen = owners.frozen_of(trials, trial.number)
    # Optuna's datetimes are naive local time of the worker's host
    others = overlapping(frozen, trials, dt.datetime.now()) if frozen is not None else []
    if not others:
        return
    host = (frozen.system_attrs.get(ATTR_OWNER) or {}).get("host")
    text = (
        f"measured while other workers ran trials on host {host} (trials "
        f"{', '.join(f'#{n}' for n in others)}): they share its cores and devices, so "
        "this measurement (and any speedup from it) is not comparable; run one worker per host"
    )
    outcome.user_attrs[ATTR_INTERFERENCE] = {"host": host, "trials": others}
    outcome.user_attrs[ATTR_WARNINGS] = [*(outcome.user_attrs.get(ATTR_WARNINGS) or []), text]
    log.warning("trial #%d %s", trial.number, text)
