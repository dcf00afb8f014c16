"""What the sweep tells the user: one progress line per trial, and the summary at the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuopt.core.fmt import duration, limit_share
from gpuopt.core.fmt import value as fmt
from gpuopt.core.limits import HighestLimit
from gpuopt.study.answers import (
    Shown,
    TwoAnswers,
    confirmation_lines,
    same_training_evidence,
    two_answers,
)
from gpuopt.study.experiment import override_diff
from gpuopt.study.keys import ATTR_INTERFERENCE, ATTR_OVERRIDES, ATTR_REPLACES, ATTR_REPLICATE_OF
from gpuopt.study.noise import NoiseView, best_noise_lines, front_lines
from gpuopt.study.records import Confirmation
from gpuopt.study.rules import unknown_training


def values_text(names: Sequence[str], values: Sequence[float] | None) -> str:
    if not values:
        return "-"
    return " ".join(f"{n}={fmt(v)}" for n, v in zip(names, values, strict=False))


def progress_line(
    done: int,
    total: int,
    number: int,
    status: str,
    names: Sequence[str],
    values: Sequence[float] | None,
    elapsed_s: float,
    eta_s: float | None,
    best: tuple[int, Sequence[float]] | None,
    baseline: bool,
    reason: str | None = None,
) -> str:
    tag = " (baseline)" if baseline else ""
    shown = values_text(names, values) if status == "ok" else (reason or status)[:120]
    best_text = f"#{best[0]} {values_text(names[:1], best[1][:1])}" if best else "-"
    return (
        f"trial {done}/{total} #{number}{tag} {status}: {shown} | elapsed {duration(elapsed_s)} "
        f"ETA {duration(eta_s)} | best {best_text}"
    )


def trial_text(names: Sequence[str], trial: Any) -> str:
    """`throughput=1,234  [key=value ...]`: a trial's values and params."""
    params = " ".join(f"{k}={fmt(v)}" for k, v in sorted(trial.params.items()))
    return f"{values_text(names, trial.values)}  [{params or '(as configured)'}]"


def render(
    *,
    study_name: str,
    storage: str | None,
    sweep_dir: str,
    names: Sequence[str],
    directions: Sequence[str],
    counts: dict[str, int],
    baseline: Any | None,
    best: Any | None,
    pareto: Sequence[Any],
    confirmation: Confirmation | None,
    best_yaml: str | None,
    elapsed_s: float,
    notes: Sequence[str] = (),
    reproduce: str | None = None,
    speedups: bool = True,
    baseline_skipped: str | None = None,
    best_pending: str | None = None,
    answers: Sequence[str] = (),
    highest_limit: HighestLimit | None = None,
    noise: NoiseView | None = None,
) -> str:
    """The end-of-sweep summary. `storage` None: an in-memory study; `speedups` False: an app's own
    values, not gpuopt's metrics; `noise`: which trials the measurements cannot tell apart."""
    lines = [
        "",
        "=" * 78,
        f"gpuopt sweep summary: study {study_name!r} ({duration(elapsed_s)})",
        "=" * 78,
    ]
    lines.append(
        "objectives: "
        + ", ".join(f"{n} ({d})" for n, d in zip(names, directions, strict=False))
        + " | trials: "
        + ", ".join(f"{k} {v}" for k, v in counts.items() if v)
    )
    if baseline is not None:
        lines.append(f"baseline  #{baseline.number}: {trial_text(names, baseline)}")
        lines.extend(_limit_lines(baseline, highest_limit))
    elif baseline_skipped:
        lines.append(f"baseline skipped: {baseline_skipped[:300]}")
    else:
        lines.append("baseline: not measured in this study")
    if best is not None:
        lines.append(f"best      #{best.number}: {trial_text(names, best)}")
        lines.extend(_limit_lines(best, highest_limit))
    else:
        lines.append(
            f"best: pending: {best_pending}" if best_pending else "best: no feasible trial"
        )
    lines.extend(answers)  # both answers first, then the confirmation they come from
    lines.extend(_comparison_lines(confirmation, baseline, best, names, directions, speedups))
    if noise is not None and best is not None:
        base = baseline.number if baseline is not None else None
        lines += [f"  {line}" for line in best_noise_lines(noise, best.number, base, confirmation)]
    lines.extend(_pareto_lines(names, pareto, noise))
    lines.extend(notes)
    lines.append(f"sweep dir: {sweep_dir}")
    if best_yaml:
        lines.append(f"best config: {best_yaml}")
        if reproduce:
            lines.append(f"  reproduce: {reproduce}")
    lines.extend(_review_lines(study_name, storage))
    lines.append("=" * 78)
    return "\n".join(lines)


def _limit_lines(trial: Any, highest: HighestLimit | None) -> list[str]:
    share = limit_share(getattr(trial, "user_attrs", None) or {}, highest)
    return [f"          at {share}"] if share else []


PARETO_SHOWN = 10


def _pareto_lines(
    names: Sequence[str], pareto: Sequence[Any], noise: NoiseView | None = None
) -> list[str]:
    """The Pareto front: with `noise`, in noise groups (within noise on every objective: one
    choice, not trade-offs); else every trial on it."""
    if noise is not None and len(names) > 1:
        return front_lines(noise, names, lambda t: trial_text(names, t), PARETO_SHOWN)
    if len(names) < 2 or not pareto:
        return []
    shown = list(pareto)[:PARETO_SHOWN]
    cut = f", {len(shown)} of {len(pareto)} shown" if len(shown) < len(pareto) else ""
    lines = [f"Pareto front ({len(pareto)} trial(s){cut}):"]
    for t in shown:
        lines.append(f"  #{t.number}: {trial_text(names, t)}")
    return lines


def _review_lines(study_name: str, storage: str | None) -> list[str]:
    """Where to read the study again; an in-memory one is gone when the sweep ends."""
    if storage is None:
        return [
            "review: the study was in memory and is not kept (storage: null); to review it "
            "later, sweep with hydra.sweeper.storage=sqlite:///PATH.db"
        ]
    return [
        f"review: python -m gpuopt.report --study {study_name} --storage {storage}",
        f"        optuna trials --study-name {study_name} --storage {storage}",
    ]


def _comparison_lines(
    confirmation: Confirmation | None,
    baseline: Any | None,
    best: Any | None,
    names: Sequence[str],
    directions: Sequence[str],
    speedups: bool = True,
) -> list[str]:
    """The confirmation round's verdict, or without one the single-measurement speedup (gpuopt's
    metrics only: an app's own value is compared as two numbers, not a speedup)."""
    if confirmation is not None and confirmation.comparisons:
        best_number = best.number if best is not None else None
        return [line.text for line in confirmation_lines(confirmation, best_number)]
    if (
        baseline is None
        or best is None
        or not baseline.values
        or not best.values
        or best.number == baseline.number
    ):
        return []
    b, c = baseline.values[0], best.values[0]
    if not speedups:
        return [
            f"best vs baseline ({names[0]}, {directions[0]}): {fmt(c)} vs {fmt(b)} "
            "(single measurements)"
        ]
    if b and c and b > 0 and c > 0:
        ratio = c / b if directions[0] == "maximize" else b / c
        # Not an answer: one reading each, no confirmation (never "speedup over baseline").
        return [
            f"not confirmed (no confirmation round): #{best.number} read {ratio:.3f}x the "
            f"baseline's {names[0]}, single readings: no answer until re-measured "
            "(hydra.sweeper.confirm.rounds)"
        ]
    return []


def repeats_lines(trials: Sequence[Any]) -> list[str]:
    """What became of the sampler's repeats (gpuopt/sweeper/repeats.py): those replaced by an
    unmeasured configuration, and the replicates run (their readings pooled with the first's)."""
    lines = []
    replaced = [t for t in trials if isinstance(t.user_attrs.get(ATTR_REPLACES), dict)]
    if replaced:
        pairs = ", ".join(
            f"#{t.number} instead of #{t.user_attrs[ATTR_REPLACES].get('repeat_of')}'s"
            for t in replaced
        )
        lines.append(
            f"repeats: the sampler asked {len(replaced)} measured configuration(s) again; "
            f"unmeasured ones ran instead ({pairs})"
        )
    replicas = [t for t in trials if isinstance(t.user_attrs.get(ATTR_REPLICATE_OF), int)]
    if replicas:
        pairs = ", ".join(f"#{t.number} of #{t.user_attrs[ATTR_REPLICATE_OF]}" for t in replicas)
        lines.append(
            f"replicates: {len(replicas)} ({pairs}): no unmeasured configuration was left, or "
            "one was enqueued; each reading pooled with its configuration's first"
        )
    return lines


def answers_lines(
    names: Sequence[str],
    baseline: Any | None,
    best: Any | None,
    same: Any | None,
    change: str | None,
    confirmation: Confirmation | None,
    global_batch: int | None,
    trials: Sequence[Any] = (),
    hint: str | None = None,
) -> list[str]:
    """The two answers (issue 13, 34): (a) the best that keeps the baseline's training math, (b) the
    best overall; each with its confirmation and change to apply; `hint`: how to declare batch keys."""
    if baseline is None or best is None:
        return []
    held = f"global batch {global_batch}" if global_batch else "the baseline's global batch"
    before = list(baseline.user_attrs.get(ATTR_OVERRIDES) or [])

    def shown(trial: Any) -> Shown:
        after = list(trial.user_attrs.get(ATTR_OVERRIDES) or [])
        apply = override_diff(before, after)[0] if trial.number != baseline.number else []
        return Shown(trial.number, trial_text(names, trial), tuple(apply))

    keep = same is not None and same.number == baseline.number
    return two_answers(
        TwoAnswers(
            held,
            shown(best),
            None if same is None else shown(same),
            baseline.number,
            confirmation,
            change,
            unknown_training(baseline),
            same_training_evidence(trials, baseline, confirmation, held) if keep else None,
            hint,
        )
    )


def interference_note(trials: Sequence[Any]) -> str | None:
    """The summary's line when any trial of the study ran beside another worker's on its host."""
    flagged = [t for t in trials if t.user_attrs.get(ATTR_INTERFERENCE)]
    if not flagged:
        return None
    hosts = sorted({str(t.user_attrs[ATTR_INTERFERENCE].get("host")) for t in flagged})
    return (
        f"INTERFERENCE: {len(flagged)} trial(s) ran at the same time as other workers' trials on "
        f"host {', '.join(hosts)}: their measurements interfere, speedups are not reliable; run "
        "one worker per host (or hydra.sweeper.n_jobs on one worker, one GPU per trial)"
    )
