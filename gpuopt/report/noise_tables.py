"""The report's noise groups (gpuopt.study.noise) in the sweep summary's words, for the text report
and the page: the Pareto front with configurations within noise of each other as one choice, the
trials tables' group column, and what noise says of the best pick.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.markup import escape
from rich.table import Table

from gpuopt.core.fmt import metric as fmt
from gpuopt.report.build import StudyReport, TrialView
from gpuopt.study.noise import runner_up_text, within_text

GROUP_HEADER = "≈"  # the trials table's noise-group column


def front_table(report: StudyReport, params_text: Callable[[TrialView], str]) -> Table:
    """The Pareto front in noise groups where the objectives are gpuopt's metrics: one row per
    choice (its best trial), the trials within noise of it beside it; else every trial on Optuna's
    front."""
    noise = report.noise
    groups = noise.front if noise is not None else []
    caption = None
    if groups:
        by_number = {t.number: t for t in report.trials}
        rows = [
            (by_number[g.leader.number], within_text(g, report.objectives) if g.size > 1 else "-")
            for g in groups
        ]
        title = (
            f"Pareto front: no trade-off beyond noise ({groups[0].size} trials, one choice)"
            if len(groups) == 1 and groups[0].size > 1
            else f"Pareto front ({len(groups)} choices beyond noise, "
            f"{sum(g.size for g in groups)} trials)"
        )
        caption = f"within noise: {noise.spread.text()}"  # type: ignore[union-attr]
    else:
        maximize = report.directions[0] == "maximize"
        ranked = sorted(report.pareto, key=lambda t: t.values[0], reverse=maximize)  # type: ignore[index]
        rows = [(t, "-") for t in ranked]
        title = f"Pareto front ({len(report.pareto)} trials)"
    table = Table(title=title, title_justify="left", caption=caption)
    table.add_column("#", justify="right")
    for name, direction in zip(report.objectives, report.directions, strict=False):
        table.add_column(f"{name} ({'max' if direction == 'maximize' else 'min'})", justify="right")
    grouped = any(g.size > 1 for g in groups)
    if grouped:
        table.add_column("within noise of it", overflow="fold")
    table.add_column("parameters", overflow="fold")
    for trial, within in rows:
        table.add_row(
            str(trial.number),
            *(fmt(n, v) for n, v in zip(report.objectives, trial.values or (), strict=False)),
            *([escape(within)] if grouped else []),
            escape(params_text(trial)),
        )
    return table


def group_cell(report: StudyReport, trial: TrialView) -> str | None:
    """The trials table's noise group of `trial` ("1": within noise of the best; None: no
    column), or "" for a trial without one (not ok)."""
    noise = report.noise
    if noise is None or all(len(g.configs) == 1 for g in noise.ranked):
        return None
    place = noise.group_of(trial.number) if trial.status == "ok" else None
    return "" if place is None else str(place)


def best_noise_lines(report: StudyReport) -> list[str]:
    """What noise says of the best pick where no confirmation said it: within noise of the
    baseline, or of its runner-up."""
    noise, best, base = report.noise, report.best, report.baseline
    if noise is None or best is None:
        return []
    lines = []
    unconfirmed = not report.confirmed and base is not None and base is not best
    if unconfirmed and noise.apart(best.number, base.number) is False:  # type: ignore[union-attr]
        lines.append("Within noise of the baseline: nothing here is measurably faster.")
    if not report.confirmed or report.confirmation.top_two is None:  # type: ignore[union-attr]
        runner_up = runner_up_text(noise, best.number)
        if runner_up:
            lines.append(runner_up[0].upper() + runner_up[1:] + ".")
    if lines and not noise.front:  # several objectives: the front's caption says it
        lines.append(f"Within noise: {noise.spread.text()}.")
    return [escape(line) for line in lines]
