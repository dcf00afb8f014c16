"""The race: a sweep's trials measured in one warm process instead of one fresh process each.

Why: a trial in a fresh process pays its imports and build (~5 s on the 2-core CPU) for a 1-2 s
window, and fresh processes differ by 4-14% from one another. Where every configuration can share
a process (policy.why_not), one process (SharedProcess) measures them all: the baseline as a whole
trial; then rounds of `race.screen` trials asked at once and screened (race/screen.py), the best
`race.finalists` at `race.floor` or faster (plus the best same-training one) read over the baseline
again and measured as whole trials, the others told PRUNED. A round's trials are all told before
the next round is asked, so a sweep longer than one screen is still guided by its sampler; the
default screen (9) is no more than `gpuopt_tpe`'s n_startup_trials (10), sampled blind anyway.

Values never mix fresh and warm processes; the published speedup is still the confirmation's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from optuna.trial import Trial, TrialState

from gpuopt.core.result import TrialResult
from gpuopt.core.shared_protocol import Failure, Reading
from gpuopt.study.keys import (
    ATTR_BASELINE,
    ATTR_CONFIG,
    ATTR_OVERRIDES,
    ATTR_RACE,
    ATTR_REASON,
    ATTR_STATUS,
)
from gpuopt.study.rules import pick_baseline
from gpuopt.sweeper import global_batch, owners, profile_runs, record, resume
from gpuopt.sweeper.comparison import calibrated
from gpuopt.sweeper.confirm.schedule import with_overrides
from gpuopt.sweeper.launchers.results import TrialDiagnostics
from gpuopt.sweeper.objectives import TrialOutcome
from gpuopt.sweeper.progress import Progress
from gpuopt.sweeper.race import policy, screen
from gpuopt.sweeper.race.screen import Turn
from gpuopt.sweeper.shared_process import SharedProcess, write_config
from gpuopt.sweeper.space import SearchSpace

log = logging.getLogger("gpuopt.sweeper")


@dataclass
class Screened:
    """One candidate of the screen: its turn, its ratio as the race decides on it (over the
    round's control build) and its two neighbouring baseline windows' readings."""

    trial: Trial
    overrides: list[str]
    label: str
    turn: Turn = field(default_factory=lambda: Turn(None))  # no window: not screened yet
    ratio: float | None = None
    neighbours: tuple[float | None, float | None] = (None, None)
    config_file: Path | None = None  # the job config the screen built it from


@dataclass
class RaceRunner:
    """A worker's trials run in one shared process; `trials` (the worker's sweeper.trials.
    TrialRunner) asks, configures and records them, its loop running a round per batch (fresh
    processes where the race cannot go on)."""

    trials: Any
    compose: Callable[[list[str]], Any] | None = None  # a job's config as the launcher composes it
    # This round's candidates that keep the baseline's training by their params (_decide)
    same_training: set[str] = field(default_factory=set)
    objective: str = "throughput"
    directory: Path = Path("race")
    process: SharedProcess | None = None  # the race's process, once started
    # the baseline's whole-trial metrics: a finalist's window metrics are told in its frame
    baseline_metrics: dict[str, Any] = field(default_factory=dict)
    baseline_overrides: list[str] = field(default_factory=list)  # the baseline trial's
    control: float | None = None  # this round's control build's ratio (policy.CONTROL)

    def run(self, study: optuna.Study, to_go: int, space: SearchSpace, progress: Progress) -> None:
        """The race; its process stays open (`process`) until the caller closes it."""
        progress.start(study.get_trials(deepcopy=False))
        race = self.process = SharedProcess.open(
            self.directory, self.objective, self.trials.options.race.window_s
        )
        if race.error:
            log.warning("race: %s; every trial in a fresh process instead", race.error)
            self.trials.run(study, to_go, space, progress)
            return
        try:
            rounds: tuple[Any, ...] = (self._round, self.trials.options.race.screen)
            if not self._baseline(study, space, progress):
                log.warning("race: no baseline to pair windows with; the rest in fresh processes")
                race.close()
                rounds = ()
            to_go = owners.trials_to_go(study.get_trials(deepcopy=False), self.trials.n_trials)
            self.trials.run(study, to_go, space, progress, *rounds)
        except BaseException:
            self.process.close()
            raise

    def _round(
        self,
        study: optuna.Study,
        trials: list[Trial],
        space: SearchSpace,
        progress: Progress,
    ) -> None:
        """One screen of `trials` (asked at once), its finalists' whole trials, every trial told."""
        with resume.beating(study, trials):
            screened = self._screen(trials, space)
            chosen = self._decide(study, screened, space, progress)
            for entry in screened:
                if entry.label in chosen:
                    self._finalist(study, entry, chosen[entry.label], space, progress)

    # ---- 1. the baseline, a whole trial -------------------------------------------------------
    def _baseline(self, study: optuna.Study, space: SearchSpace, progress: Progress) -> bool:
        """Trial 0 as a whole trial (unless a raced study resumes with it done), then the baseline
        built for the screen; whether both worked."""
        done = next(  # a raced study's baseline (from an earlier race), if it resumes
            (
                t
                for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.user_attrs.get(ATTR_BASELINE) and ATTR_RACE in t.user_attrs
            ),
            None,
        )
        if done is not None:  # its stored overrides (a secret in them masked: none in a task's)
            overrides = list(done.user_attrs.get(ATTR_OVERRIDES) or [])
        else:
            trials, _ = self.trials.ask(study, 1)
            if not trials:
                return False
            trial = trials[0]
            overrides = self.trials.configure(trial, space)
            self._whole(study, trial, overrides, space, progress)
            done = study.get_trials(deepcopy=False)[trial.number]
        if done.state != TrialState.COMPLETE or not done.user_attrs.get(ATTR_BASELINE):
            return False
        self.baseline_metrics = dict(done.user_attrs)
        self.baseline_overrides = overrides
        answer = self.process.add(policy.BASELINE, self._config_file(overrides, policy.BASELINE))
        return answer.status == "ok"

    # ---- 2. the screen ------------------------------------------------------------------------
    def _screen(self, trials: list[Trial], space: SearchSpace) -> list[Screened]:
        """B ctl B ctl ... B c1 B c1 ... B (race/screen.py), each arm built only for its turn."""
        entries = [Screened(t, self.trials.configure(t, space), f"#{t.number}") for t in trials]
        control = with_overrides(self.baseline_overrides, [policy.SCREEN_WARMUP])
        configs = {policy.CONTROL: self._config_file(control, policy.CONTROL)}
        for entry in entries:
            screened_as = with_overrides(entry.overrides, [policy.SCREEN_WARMUP])
            entry.config_file = self._config_file(screened_as, f"trial{entry.trial.number}")
            configs[entry.label] = entry.config_file
        by_label = {entry.label: entry for entry in entries}
        done: list[str] = []

        def report(label: str, turn: Turn, ratio: float | None) -> None:
            entry, entry.turn, entry.ratio = by_label[label], turn, ratio
            done.append(label)
            log.info(screen_line(entry, len(done), len(entries), self.objective))

        compared, windows = screen.screen(
            self.process, configs, self.objective, self.trials.options.race, self._restart, report
        )
        metric = policy.SCREEN_METRIC[self.objective]
        ratios, self.control = calibrated(screen.raw_ratios(compared, metric), policy.CONTROL)
        for entry in entries:
            readings = compared.of(entry.label)  # its turn's windows
            first, last = readings[0], readings[-1]
            entry.turn, entry.ratio = (
                windows.turns.get(entry.label, entry.turn),
                ratios[entry.label],
            )
            entry.neighbours = (compared.neighbours(first)[0], compared.neighbours(last)[1])
        return entries

    def _restart(self) -> SharedProcess:
        """A new race process with the baseline built (after a candidate too slow to screen)."""
        race = self.process = SharedProcess.open(
            self.directory, self.objective, self.trials.options.race.window_s
        )
        race.add(policy.BASELINE, self.directory / f"{policy.BASELINE}.yaml")
        return race

    def _decide(
        self,
        study: optuna.Study,
        screened: list[Screened],
        space: SearchSpace,
        progress: Progress,
    ) -> dict[str, dict[str, Any]]:
        """The finalists by label, each with its `race` user attr; the others recorded (failed as
        their failure, else pruned)."""
        ratios = {entry.label: entry.ratio for entry in screened}
        rule = global_batch.read(study.user_attrs)
        baseline = pick_baseline(study.get_trials(deepcopy=False))
        self.same_training = {  # global_batch.keeps_training
            entry.label
            for entry in screened
            if rule is not None
            and baseline is not None
            and entry.turn.failure() is None
            and global_batch.keeps_training(rule, entry.trial.params, baseline.params)
        }
        race = self.trials.options.race
        chosen = policy.finalists(ratios, race.finalists, race.floor, self.same_training)
        if len(chosen) > race.finalists:
            log.info(
                "race: %s goes on as the same-training finalist (%.2fx the baseline): the best "
                "overall ones change the global batch",
                chosen[-1],
                ratios[chosen[-1]] or 0.0,
            )
        for entry in screened:
            if (failure := entry.turn.failure()) is not None:
                ret = _returned(failure)
                self.trials.record(study, entry.trial, entry.overrides, ret, space, progress)
            elif entry.label not in chosen:
                self._prune(study, entry, self._screen_record(entry, ratios), progress)
        by_label = {entry.label: entry for entry in screened}
        return {label: self._screen_record(by_label[label], ratios) for label in chosen}

    def _screen_record(self, entry: Screened, ratios: dict[str, float | None]) -> dict[str, Any]:
        """What the screen read of a candidate (its `race` user attr)."""
        return {
            "ratio": ratios.get(entry.label),
            "rank": policy.rank_of(entry.label, ratios),
            "of": len(ratios),
            "window_s": self.trials.options.race.window_s,
            "floor": self.trials.options.race.floor,
            "control": self.control,  # the ratio is over the control's (policy.CONTROL)
            "same_training": entry.label in self.same_training,  # holds the global batch and lr
            "window": {
                **(entry.turn.window.to_json() if entry.turn.window else {}),
                "baseline_before": entry.neighbours[0],
                "baseline_after": entry.neighbours[1],
            },
        }

    def _prune(
        self,
        study: optuna.Study,
        entry: Screened,
        read: dict[str, Any],
        progress: Progress,
        reason: str | None = None,
    ) -> None:
        """Told PRUNED, with `read` as its `race` user attr."""
        ratio, rank, of = read["ratio"], read["rank"], read["of"]
        reason = reason or prune_reason(entry, ratio, rank, of, self.trials.options.race)
        attrs = {
            ATTR_OVERRIDES: entry.overrides,
            ATTR_STATUS: "pruned",
            ATTR_REASON: reason,
            ATTR_CONFIG: entry.turn.config,
            ATTR_RACE: read,
        }
        reading = _value(entry.turn.window, policy.SCREEN_METRIC[self.objective])
        record.prune_trial(study, entry.trial, attrs, reading)
        outcome = TrialOutcome("pruned", None, user_attrs={ATTR_REASON: reason})
        log.info(
            progress.record(entry.trial.number, False, outcome, study.get_trials(deepcopy=False))
        )

    # ---- 3. the finalists: read over the baseline, then whole trials ---------------------------
    def _finalist(
        self,
        study: optuna.Study,
        entry: Screened,
        screened: dict[str, Any],
        space: SearchSpace,
        progress: Progress,
    ) -> None:
        """`entry` read over the baseline in more windows; pruned if that reads it below the floor,
        else measured as a whole trial told in the baseline's frame."""
        paired, self.process = screen.read_over_baseline(
            self.process, entry.label, entry.config_file, self.objective, self.trials.options.race,
            self._restart, self.control,
        )  # fmt: skip
        screened = {**screened, "paired": paired.to_json()}
        ratio = paired.ratio(policy.SCREEN_METRIC[self.objective])
        floor = self.trials.options.race.floor
        log.info("race: %s", paired_line(entry, paired, self.objective))
        if ratio is None or ratio < floor:
            read = "no paired reading" if ratio is None else f"{ratio:.2f}x the baseline"
            reason = (
                f"raced out: {read} in its {screened['paired']['windows']} windows after the "
                f"screen; below the race's floor of {floor:g}x: cannot be an answer"
            )
            self._prune(study, entry, screened, progress, reason)
            return
        self._whole(study, entry.trial, entry.overrides, space, progress, screened, paired)

    def _whole(
        self,
        study: optuna.Study,
        trial: Trial,
        overrides: list[str],
        space: SearchSpace,
        progress: Progress,
        raced: dict[str, Any] | None = None,
        paired: screen.Paired | None = None,
    ) -> None:
        """`trial` measured as a whole trial of the race process (profiled when profiling is on, so
        the best needs no extra profiled run), recorded; a finalist's (`raced`, `paired`) told in
        the baseline's frame, its `race` user attr with the whole trial's seconds and readings."""
        launched = (
            [*overrides, profile_runs.PROFILE_ON]
            if profile_runs.enabled(self.trials.options)
            else overrides
        )
        run_dir = self.directory.parent / f"trial_{trial.number}"
        config = self._config_file(launched, f"trial{trial.number}")
        started = time.monotonic()
        result = self.process.whole_trial(f"#{trial.number}", config, run_dir)
        if result is None:
            ret: Any = RuntimeError(f"the race process failed: {self.process.error}")
        else:
            seconds = time.monotonic() - started
            screened = {**(raced or {}), "seconds": seconds}
            if paired is not None and result.ok:
                result, own = screen.over_baseline(result, self.baseline_metrics, paired)
                screened["whole_window"] = own
            ret = _returned(result, run_dir, self.directory)
            record.trial_attrs(study, trial, {ATTR_RACE: screened})
        self.trials.record(study, trial, overrides, ret, space, progress)

    def _config_file(self, overrides: list[str], stem: str) -> Path:
        """The job config the launcher would compose for `overrides`, as `<stem>.yaml`."""
        assert self.compose is not None
        return write_config(self.compose(list(overrides)), self.directory, f"{stem}.yaml")


def screen_line(entry: Screened, done: int, total: int, objective: str) -> str:
    """The progress line of one screened candidate, with the ratio the race decides on."""
    head = f"race: screened {done}/{total} #{entry.trial.number}"
    failure = entry.turn.failure()
    if failure is not None:
        return f"{head} {failure.status.value}: {failure.reason}"
    if isinstance(entry.turn.window, Failure):  # too slow to screen
        return f"{head}: too slow to screen ({entry.turn.window.reason})"
    metric = policy.SCREEN_METRIC[objective]
    said = "" if entry.ratio is None else f" ({entry.ratio:.2f}x the baseline)"
    value, build_s = _value(entry.turn.window, metric), entry.turn.build_s or 0.0
    return f"{head}: {metric}={value:.4g}{said}, built in {build_s:.1f} s"


def paired_line(entry: Screened, paired: screen.Paired, objective: str) -> str:
    """The progress line of a finalist's read over the baseline (before its whole trial)."""
    metric = policy.SCREEN_METRIC[objective]
    read = paired.read(metric)
    head = f"#{entry.trial.number} read over the baseline in {paired.to_json()['windows']} windows"
    if not read:
        return f"{head}: no paired reading"
    ci = f" [95% CI {read['ci'][0]:.2f}-{read['ci'][1]:.2f}]" if read.get("ci") else ""
    return f"{head}: {read['ratio']:.2f}x{ci} on {metric}"


def prune_reason(entry: Screened, ratio: float | None, rank: int | None, of: int, race: Any) -> str:
    """Why a candidate went no further, as its `reason` user attr says it."""
    if ratio is None:
        why = entry.turn.window.reason if isinstance(entry.turn.window, Failure) else "no window"
        return f"raced out: too slow to screen ({why})"
    n = len(entry.turn.slices) or 1
    where = (
        "on its drain steps, its fastest"
        if isinstance(entry.turn.window, Reading) and entry.turn.window.read_on_drain
        else f"in {n} window{'s' if n > 1 else ''} of {race.window_s:g} s"
    )
    head = f"raced out: {ratio:.2f}x the baseline {where} (rank {rank} of {of}"
    if ratio < race.floor:
        return f"{head}; below the race's floor of {race.floor:g}x: cannot be an answer)"
    return f"{head}; the best {race.finalists} went on)"


def _value(answer: Reading | Failure | None, metric: str) -> float | None:
    return answer.value(metric) if isinstance(answer, Reading) else None


def _returned(result: TrialResult, run_dir: Path | None = None, logs: Path | None = None) -> Any:
    """A JobReturn as a launcher gives one back, so the trial is recorded as every trial is."""
    ret = JobReturn(overrides=[], status=JobStatus.COMPLETED, _return_value=result)
    log_file = [str(logs / "interleave.log")] if logs is not None else []
    ret.gpuopt_diagnostics = TrialDiagnostics(  # type: ignore[attr-defined]
        logs=log_file, run_dir=str(run_dir) if run_dir else None, traceback=None
    )
    return ret
