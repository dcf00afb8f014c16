"""What a study's confirmation and its two answers say, in words: one text for the sweep summary
and the report, so the two never disagree. A `Line`'s `emphasis` says which lines a terminal may
set off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from optuna.trial import TrialState

from gpuopt.core.stats import TOO_NOISY
from gpuopt.study.keys import ATTR_BASELINE, ATTR_RACE
from gpuopt.study.records import IN_PROCESS, Comparison, Confirmation
from gpuopt.study.rules import feasible_trials, same_training, training_change

KEEP_BASELINE = "no candidate is measurably faster than the baseline: keep your configuration"
KEEP_SAME = "no same-training configuration is measurably faster: keep your configuration"
STRONG = "strong"  # the best trial's verdict, "keep your configuration"
WARNING = "warning"  # re-measurements that failed


class Line(NamedTuple):
    text: str
    emphasis: str = ""  # "" | STRONG | WARNING


def speedup_text(entry: Comparison) -> str:
    """A stored speedup: ratio, CI at its level, its half-width, the pairs, the verdict; "too noisy
    here" with the spread and the load instead of an interval too wide to act on."""
    if not entry.measured:
        return entry.error or "n/a"
    ratio = entry.ratio
    if entry.ci_low is None or entry.ci_high is None:
        return f"{ratio:.3f}x (no CI: needs >= 2 measurements each)"
    if entry.verdict == TOO_NOISY:
        return _too_noisy(entry)
    pairs = entry.n_pairs
    sample = f"{pairs} pairs" if pairs else f"n={entry.n_candidate}/{entry.n_reference}"
    width = "" if entry.halfwidth is None else f", +-{_percent(entry.halfwidth)}"
    verdict = "" if entry.distinguishable else ", not distinguishable from 1.0x"
    ci = f"{entry.ci_name} {entry.ci_low:.3f}-{entry.ci_high:.3f}"
    return f"{ratio:.3f}x [{ci}{width}, {sample}{verdict}]"


def _too_noisy(entry: Comparison) -> str:
    """What was seen (the pairs' spread, the load), and what a +-target interval would take."""
    seen = f"{entry.n_pairs} pairs' log-ratios spread {_percent(entry.log_sd or 0.0)}"
    if entry.load_1m:
        cpus = "?" if entry.cpus is None else entry.cpus
        seen += f", load {entry.load_1m[0]:.1f}-{entry.load_1m[1]:.1f} on {cpus} CPUs"
    if entry.steal_pct is not None and entry.steal_pct >= 0.5:
        seen += f", {entry.steal_pct:.0f}% of the CPU time taken by the hypervisor"
    goal = f" to +-{_percent(entry.target_halfwidth)}" if entry.target_halfwidth else ""
    more = (
        f"; ~{entry.pairs_needed} pairs would narrow it{goal} (confirm.max_share)"
        if entry.pairs_needed
        else ""
    )
    return (
        f"too noisy here: {entry.ratio:.2f}x +-{_percent(entry.halfwidth or 0.0)} "
        f"({entry.ci_name}) is no answer ({seen}){more}"
    )


def _percent(fraction: float) -> str:
    return ">100%" if fraction > 1.0 else f"{100 * fraction:.1f}%"


def confirmation_lines(confirmation: Confirmation, best_number: int | None) -> list[Line]:
    """Each candidate vs the baseline (the best's line STRONG), "keep your configuration" when the
    best is the baseline, the top two, and re-measurements that failed."""
    c = confirmation
    window = 1.0 if c.window_s is None else c.window_s
    how = "interleaved fresh processes"
    if c.mode == IN_PROCESS:
        how = f"in alternating {window:g} s windows in one process"
    known = {k: "?" if v is None else v for k, v in vars(c).items()}
    lines = [
        Line(
            f"Confirmation: {known['rounds']} round(s) {how}, baseline + top {known['top_k']}, "
            f"on {known['objective']}:"
        )
    ]
    for entry in c.comparisons:
        best = entry.trial_number == best_number
        mark = ", the best" if best else ""
        text = f"  {entry.label} (trial #{entry.trial_number}{mark}) vs baseline: "
        lines.append(Line(text + speedup_text(entry), STRONG if best else ""))
    if best_number is not None and best_number == c.baseline_number:
        lines.append(Line(f"  {KEEP_BASELINE}", STRONG))
    if c.top_two is not None:
        labels = " vs ".join(c.top_two.labels)
        lines.append(Line(f"  top two ({labels}): {speedup_text(c.top_two)}"))
    for f in c.configs:
        failed = ", ".join(s for s in f.confirm_statuses if s != "ok")  # oom, error, ...
        if failed:
            text = f"  {f.label} (trial #{f.trial_number}): re-measurements ended as {failed}"
            lines.append(Line(text, WARNING))
    return lines


@dataclass(frozen=True)
class Shown:
    """A trial as an answer names it: its number, how the caller shows it (values, params) and
    the change to apply (its overrides the baseline's lack)."""

    number: int
    text: str
    apply: tuple[str, ...] = ()


@dataclass(frozen=True)
class TwoAnswers:
    """What the two answers say, from the study. `held`: the global batch the same training
    keeps, in words; `unknown`: what the baseline did not report (then (a) is unknown, never a
    guess); `evidence`: where (a) is the baseline, what the search saw."""

    held: str
    best: Shown
    same: Shown | None
    baseline_number: int | None
    confirmation: Confirmation | None = None
    change: str | None = None
    unknown: str | None = None
    evidence: str | None = None
    hint: str | None = None


def two_answers(a: TwoAnswers) -> list[str]:
    """(a) the best trial that keeps the baseline's training math, (b) the best overall and what it
    changes, each with its own confirmation and its change to apply."""
    lines = [f"two answers (same training = {a.held}, same lr, numerics within tolerance):"]
    if a.unknown is not None and a.best.number != a.baseline_number:
        lines.append(f"  (a) same training: unknown: {a.unknown}")
    elif a.same is None:
        lines.append("  (a) same training: no feasible trial keeps the baseline's training")
    elif a.same.number == a.baseline_number:
        lines.append(f"  (a) same training: {KEEP_SAME}")
        if a.evidence:
            lines.append(f"      ({a.evidence})")
    else:
        lines += _answer(a, "(a) same training", a.same)
    if a.hint:
        lines.append(f"      {a.hint}")
    if a.same is not None and a.best.number == a.same.number:
        lines.append("  (b) best overall: the same trial (it keeps the training)")
        return lines
    lines += _answer(a, "(b) best overall", a.best)
    if a.change:
        lines.append(f"      changes the training: {a.change}")
    return lines


def _answer(a: TwoAnswers, head: str, shown: Shown) -> list[str]:
    """One answer's trial, how it was confirmed against the baseline, and its change to apply."""
    entry = a.confirmation.comparison_of(shown.number) if a.confirmation is not None else None
    said = f"confirmed {speedup_text(entry)}" if entry else "not confirmed (single measurement)"
    if shown.number == a.baseline_number:
        said = "the baseline itself"
    apply = [f"      change to apply: {' '.join(shown.apply)}"] if shown.apply else []
    return [f"  {head}: #{shown.number} {shown.text}: {said}", *apply]


def same_training_evidence(
    trials: Sequence[Any], baseline: Any, confirmation: Confirmation | None, held: str
) -> str:
    """Why answer (a) is the baseline itself, from what the search saw of the same training."""
    same = [
        t
        for t in feasible_trials(trials)
        if not t.user_attrs.get(ATTR_BASELINE) and same_training(t, baseline)
    ]
    numbers = {t.number for t in same}
    if same and confirmation is not None:
        entries = [e for e in confirmation.comparisons if e.trial_number in numbers and e.measured]
        if not entries:
            return f"same-training #{same[0].number} was not re-measured"
        entry = max(entries, key=lambda e: e.ratio or 0.0)
        return f"same-training #{entry.trial_number} re-measured {speedup_text(entry)}"
    if same:
        return f"same-training #{same[0].number} measured once, no faster than the baseline"
    return _screened_evidence(trials, baseline) or f"no trial held {held}"


def _screened_evidence(trials: Sequence[Any], baseline: Any) -> str | None:
    """What the race read of its candidates that held the training by their params: a finalist
    read below the floor after the screen, one the numerics guard turned down, or the closest the
    screen read below its floor."""
    records = [
        (t, t.user_attrs[ATTR_RACE])
        for t in trials
        if isinstance(t.user_attrs.get(ATTR_RACE), dict)
        and t.user_attrs[ATTR_RACE].get("same_training")
    ]
    slower = [(t, r) for t, r in records if t.state == TrialState.PRUNED and r.get("paired")]
    if slower:
        trial, record = slower[0]
        floor = record.get("floor")
        below = f"{floor:g}x the baseline" if isinstance(floor, int | float) else "the baseline"
        return f"same-training #{trial.number} read below {below} after the screen"
    whole = [t for t, _ in records if t.state == TrialState.COMPLETE]
    if whole:  # held the global batch, but not the training: the guard said no
        return f"#{whole[0].number} held the global batch: {training_change(baseline, whole[0])}"
    screened = [
        (r["ratio"], t.number, r.get("floor"))
        for t, r in records
        if t.state == TrialState.PRUNED and isinstance(r.get("ratio"), (int, float))
    ]
    if not screened:
        return None
    ratio, number, floor = max(screened)
    below = f"at the race's floor of {floor:g}x or faster" if floor else "faster"
    return f"no same-training candidate screened {below}: the closest, #{number}, {ratio:.2f}x"
