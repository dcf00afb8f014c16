"""The report's tables, each described once (its columns: a header and how a row reads into a cell)
and drawn twice: as a rich table in the terminal and as an HTML <table> on the report page."""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table as RichTable
from rich.text import Text

from gpuopt.core.fmt import metric as fmt
from gpuopt.core.metrics import columns, goals, unit
from gpuopt.report.build import COMPARED_METRICS, StudyReport, TrialView
from gpuopt.report.diagnose import Bottleneck
from gpuopt.study.noise import within_text


@dataclass(frozen=True)
class Cell:
    text: str
    sort: float | None = None  # the page sorts a number column by it
    style: str = ""  # rich's, in the terminal


@dataclass(frozen=True)
class Col:
    header: str
    read: Callable[[Any], Cell | str]  # a row's cell
    text: bool = False  # left-aligned and folded; else a number: right-aligned, sorted by value


@dataclass
class Table:
    title: str
    columns: list[Col]
    rows: Sequence[Any]
    caption: str | None = None
    strong: Callable[[Any], bool] = field(default=lambda row: False)  # rows shown in bold


def rows_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[Cell | str]], numbers: bool = True
) -> Table:
    """A table of ready cells: the first column names the row, the others are numbers (or text)."""
    cols = [
        Col(h, lambda row, i=i: row[i], text=i == 0 or not numbers) for i, h in enumerate(headers)
    ]
    return Table(title, cols, rows)


def _cell(value: Cell | str) -> Cell:
    return value if isinstance(value, Cell) else Cell(value)


def to_rich(table: Table) -> RichTable:
    result = RichTable(title=table.title, title_justify="left", caption=table.caption)
    for col in table.columns:
        if col.text:
            result.add_column(col.header, overflow="fold", min_width=len(col.header))
        else:
            result.add_column(col.header, justify="right")
    for row in table.rows:
        cells = (_cell(col.read(row)) for col in table.columns)
        result.add_row(
            *(Text(c.text, style=c.style) for c in cells),
            style="bold" if table.strong(row) else None,
        )
    return result


def to_html(table: Table, css: str) -> str:
    """A <table class=css>, the title its caption; number cells carry their value (data-value) for
    the page's sorting."""

    def td(col: Col, cell: Cell) -> str:
        if col.text:
            return f"<td>{html.escape(cell.text)}</td>"
        value = "NaN" if cell.sort is None else cell.sort
        return f'<td class="num" data-value="{value}">{html.escape(cell.text)}</td>'

    caption = table.title + (f" ({table.caption})" if table.caption else "")
    head = "".join(f"<th>{html.escape(col.header)}</th>" for col in table.columns)
    rows = []
    for row in table.rows:
        cells = "".join(td(col, _cell(col.read(row))) for col in table.columns)
        strong = ' class="best"' if table.strong(row) else ""
        rows.append(f"<tr{strong}>{cells}</tr>")
    return (
        f'<table class="{css}"><caption>{html.escape(caption)}</caption><thead><tr>{head}</tr>'
        f"</thead><tbody>{''.join(rows)}</tbody></table>"
    )


def number(name: str, value: float | None, with_unit: bool = True) -> Cell:
    return Cell(fmt(name, value, unit=with_unit), sort=value)


def short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def change(name: str, base: float | None, best: float | None) -> Cell:
    """Best vs baseline: points for percentages, else a ratio; green/red by the metric's goal."""
    if base is None or best is None or (unit(name) != "%" and base == 0):
        return Cell("")
    if unit(name) == "%":
        delta, text = best - base, f"{best - base:+.1f} pts"
    else:
        delta, text = best / base - 1.0, f"x{best / base:.2f}"
    goal = goals().get(name)
    if goal is None or abs(delta) < 1e-12:
        return Cell(text, delta)
    return Cell(text, delta, "green" if (delta > 0) == (goal == "maximize") else "red")


# -- the report's tables ---------------------------------------------------------------------------
# Bottleneck labels short enough for a table column.
BOTTLENECK_SHORT = {
    Bottleneck.INPUT: "input",
    Bottleneck.HOST: "host/launch",
    Bottleneck.MEMORY_OR_SMALL_KERNELS: "memory/small kernels",
    Bottleneck.NEAR_LIMIT: "near limit",
    Bottleneck.AT_MACHINE_LIMIT: "machine limit",
    Bottleneck.COMPUTE: "compute",
    Bottleneck.UNKNOWN: "unknown",
    Bottleneck.NOT_MEASURED: "-",
}
# Sampled parameters get a column each up to this many; more go into one folded column.
MAX_PARAM_COLUMNS = 4
STATUS_STYLE = {
    "ok": "green",
    "oom": "yellow",
    "diverged": "yellow",
    "error": "red",
    "running": "cyan",
}
GROUP_HEADER = "≈"  # the trials table's noise-group column


def counts(report: StudyReport) -> Table:
    statuses = [
        Col(s, lambda _, s=s: Cell(str(report.counts[s]), style=STATUS_STYLE.get(s, "")))
        for s in report.counts
    ]
    total = Col("total", lambda _: Cell(str(sum(report.counts.values())), style="bold"))
    return Table("Trials by status", [*statuses, total], [None])


def comparison(report: StudyReport) -> Table:
    """Baseline vs best on the objectives and the compared metrics."""
    best, base = report.best, report.baseline
    assert best is not None
    names = [
        n
        for n in dict.fromkeys([*report.objectives, *COMPARED_METRICS])
        if best.metric(n) is not None or (base is not None and base.metric(n) is not None)
    ]
    cols = [Col("metric", lambda n: n, text=True)]
    if base is not None:
        status = "" if base.status == "ok" else f" ({base.status})"
        cols.append(Col(f"baseline #{base.number}{status}", lambda n: number(n, base.metric(n))))
    cols.append(Col(f"best #{best.number}", lambda n: Cell(fmt(n, best.metric(n)), style="bold")))
    if base is not None:
        cols.append(Col("change", lambda n: change(n, base.metric(n), best.metric(n))))
    return Table("Baseline vs best", cols, names)


def config_changes(report: StudyReport) -> Table:
    return Table(
        "Resolved config: keys that differ",
        [
            Col("key", lambda i: i.key, text=True),
            Col("baseline", lambda i: short(i.baseline), text=True),
            Col("best", lambda i: Cell(short(i.best), style="bold"), text=True),
        ],
        report.config_changes,
    )


def params_text(trial: TrialView) -> str:
    """The sampled parameters (or the overrides of a trial without any), one `key=value` each."""
    if trial.params:
        return " ".join(f"{k}={v}" for k, v in trial.params.items())
    return " ".join(trial.overrides or [])


def group_cell(report: StudyReport, trial: TrialView) -> str | None:
    """The trials table's noise group of `trial` ("1": within noise of the best; None: no
    column), or "" for a trial without one (not ok)."""
    noise = report.noise
    if noise is None or all(len(g.configs) == 1 for g in noise.ranked):
        return None
    place = noise.group_of(trial.number) if trial.status == "ok" else None
    return "" if place is None else str(place)


def best_first(report: StudyReport, trials: list[TrialView]) -> list[TrialView]:
    """`trials` (with values) by the first objective, best first."""
    maximize = report.directions[0] == "maximize"
    return sorted(trials, key=lambda t: t.values[0], reverse=maximize)  # type: ignore[index]


def trials(report: StudyReport, limit: int | None) -> tuple[Table, int]:
    """The ok trials best first (by the first objective), then the rest by number; returns the
    table and how many trials it leaves out."""
    ranked = best_first(report, report.ok_trials)
    ranked += [t for t in report.trials if t not in ranked]
    shown = list(ranked if limit is None else ranked[:limit])
    if report.baseline is not None and report.baseline not in shown:
        shown.append(report.baseline)

    def mark(t: TrialView) -> Cell:
        text = f"{t.number}{' B' if t.baseline else ''}{' *' if t is report.best else ''}"
        return Cell(text, t.number)

    def objective(k: int, name: str) -> Col:
        def read(t: TrialView) -> Cell:
            ok = t.status == "ok" and t.values  # infeasible trials' values are worst cases
            return number(name, t.values[k] if ok else None, with_unit=False)  # type: ignore[index]

        return Col(name, read)

    def group(t: TrialView) -> Cell:
        place = group_cell(report, t)
        return Cell(place or "", int(place) if place else None)

    def verdict(t: TrialView) -> Cell:  # ok trials: their bottleneck; the others: how they ended
        if t.status == "ok":
            return Cell(BOTTLENECK_SHORT[t.diagnosis.bottleneck])
        return Cell(t.status, style=STATUS_STYLE.get(t.status, "white"))

    grouped = report.best is not None and group_cell(report, report.best) is not None
    # The metrics with a column (the terminal's shorter header where it has one), unless an
    # objective, and only where a shown trial has a value.
    metrics = dict(columns("page"))
    metrics.update(columns("column"))
    shown_metrics = [
        (name, c.header)
        for name, c in metrics.items()
        if name not in report.objectives and any(t.metric(name) is not None for t in shown)
    ]
    # One column per sampled parameter (headed by its last dotted part) while they fit; else, and
    # for trials without sampled parameters, one folded column of key=value.
    param_names = list(dict.fromkeys(k for t in report.trials for k in t.params))
    if 0 < len(param_names) <= MAX_PARAM_COLUMNS:
        params = [
            Col(p.rsplit(".", 1)[-1], lambda t, p=p: str(t.params.get(p, "-")), text=True)
            for p in param_names
        ]
    else:
        params = [Col("parameters", params_text, text=True)]
    cols = [
        Col("#", mark),
        *([Col(GROUP_HEADER, group)] if grouped else []),
        *(objective(k, name) for k, name in enumerate(report.objectives)),
        *(Col(header, lambda t, n=name: number(n, t.metric(n))) for name, header in shown_metrics),
        Col("bottleneck", verdict, text=True),
        *params,
    ]
    units = ", ".join(f"{n} in {unit(n)}" for n in report.objectives if unit(n) not in ("", "%"))
    noise = (
        f"; {GROUP_HEADER} = noise group: one number, no measurable difference" if grouped else ""
    )
    title = "Trials (best first; B = baseline, * = best" + (f"; {units}" if units else "")
    table = Table(title + noise + ")", cols, shown, strong=lambda t: t is report.best)
    return table, len(ranked) - len(shown)


def front(report: StudyReport) -> Table:
    """The Pareto front in noise groups where the objectives are gpuopt's metrics: one row per
    choice (its best trial), the trials within noise of it beside it; else every trial on Optuna's
    front."""
    noise = report.noise
    groups = noise.front if noise is not None else ()
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
        rows = [(t, "-") for t in best_first(report, report.pareto)]
        title = f"Pareto front ({len(report.pareto)} trials)"

    def objective(k: int, name: str, direction: str) -> Col:
        header = f"{name} ({'max' if direction == 'maximize' else 'min'})"
        return Col(header, lambda row: number(name, row[0].values[k]))  # feasible: has values

    cols = [
        Col("#", lambda row: Cell(str(row[0].number), row[0].number)),
        *(
            objective(k, *pair)
            for k, pair in enumerate(zip(report.objectives, report.directions, strict=True))
        ),
    ]
    if any(g.size > 1 for g in groups):
        cols.append(Col("within noise of it", lambda row: row[1], text=True))
    cols.append(Col("parameters", lambda row: params_text(row[0]), text=True))
    return Table(title, cols, rows, caption)


def importances(report: StudyReport) -> Table:
    imps = list(report.importances.values())
    return rows_table(
        "Which parameters mattered (PED-ANOVA, ok trials)",
        ["parameter", *report.importances],
        [(p, *(f"{imp.get(p, 0.0):.2f}" for imp in imps)) for p in imps[0]],
    )
