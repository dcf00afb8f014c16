"""The report page (`python -m gpuopt.report --html PATH`): one self-contained file, read top down:
the two answers (docs/same-training.md) with their speedups and changes, where the time goes (the
profiled phases), the search (charts, then the Pareto front in noise groups, where Optuna's chart
draws every front trial), the trials (sortable), the full terminal report folded.

Offline: plotly.js is inlined once with the first chart; no external script, font or style. Laid
out for a laptop screen (1366 px): charts in a grid of two fixed columns (one below 1100 px), fixed
so that a chart has its final width when plotly draws it (plotly re-lays out on window resizes
only).
"""

from __future__ import annotations

import html
import importlib.util
from pathlib import Path
from typing import Any

import optuna

from gpuopt.report import tables
from gpuopt.report.build import StudyReport, TrialView
from gpuopt.report.charts import figures, phases_figure, speedup_figure
from gpuopt.report.tables import to_html
from gpuopt.study.answers import KEEP_SAME

PLOTLY_HINT = "plots need plotly: pip install 'gpuopt[report]'"
CHART_HEIGHT = 360  # px: two charts side by side and a heading fit a laptop screen
PLOT_CONFIG = {"responsive": True, "displaylogo": False}

_STYLE = """
* { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
main { max-width: 1280px; margin: 0 auto; padding: 1em 1.5em 3em; }
h1 { font-size: 1.5em; margin: 0.3em 0; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.sub { color: #666; margin: 0 0 1em; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(220px, 1fr)); gap: 1em; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 0.8em 1em; }
.card .label { color: #666; font-size: 0.85em; } .card .value { font-size: 1.6em; font-weight: 600; }
.card .note { color: #666; font-size: 0.85em; }
.answers { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 1em; margin: 1em 0; }
@media (max-width: 1100px) { .answers { grid-template-columns: minmax(0, 1fr); } }
.answer { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 0.3em 1em; }
.answer h3 { font-size: 1em; margin: 0.5em 0; } p.change { color: #8a3b12; }
.grid { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 1em; }
@media (max-width: 1100px) { .grid { grid-template-columns: minmax(0, 1fr); } }
.chart { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 0.5em; min-width: 0; }
.chart h3 { font-size: 1em; margin: 0.2em 0.4em; }
.note { color: #8a6d3b; }
code { background: #eee; padding: 0 0.25em; border-radius: 3px; word-break: break-word; }
table { width: 100%; border-collapse: collapse; background: #fff; font-size: 0.9em; margin: 1em 0; }
caption { text-align: left; font-weight: 600; padding: 0.3em 0; }
th, td { border-bottom: 1px solid #e5e5e5; padding: 0.3em 0.4em; text-align: left;
  overflow-wrap: anywhere; vertical-align: top; }
th { cursor: pointer; background: #f0f0f0; user-select: none; }
th[aria-sort="ascending"]::after { content: " \\25B2"; }
th[aria-sort="descending"]::after { content: " \\25BC"; }
tr.best td { font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
details pre { font-size: 12px; overflow-x: auto; }
"""

# Sorting a table: numbers by value (data-value), the rest as text; click again to flip.
_SORT_SCRIPT = """
document.querySelectorAll("table").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, column) {
    th.addEventListener("click", function () {
      var ascending = th.getAttribute("aria-sort") !== "ascending";
      table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      function key(row) {
        var cell = row.cells[column], v = cell.getAttribute("data-value");
        return v === null ? cell.textContent : parseFloat(v);
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (typeof x === "number" && isNaN(x)) return 1;
        if (typeof y === "number" && isNaN(y)) return -1;
        var order = typeof x === "number" ? x - y : String(x).localeCompare(String(y));
        return ascending ? order : -order;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


# -- sections -------------------------------------------------------------------------------------
def _card(label: str, value: str, note: str = "") -> str:
    note_html = f'<div class="note">{note}</div>' if note else ""
    return (
        f'<div class="card"><div class="label">{_e(label)}</div>'
        f'<div class="value">{value}</div>{note_html}</div>'
    )


def _throughput(trial: TrialView | None) -> str:
    value = trial.metric("throughput") if trial is not None else None
    return "-" if value is None else f"{value:,.0f}<small> samples/s</small>"


def _speedup_card(report: StudyReport, label: str, trial: TrialView | None) -> str:
    """One answer's card: its confirmed speedup with its interval, else the one-measurement
    ratio (said so), "keep" for the baseline itself."""
    if trial is None:
        return _card(label, "-", "no feasible trial")
    if trial is report.baseline:
        return _card(f"{label}: the baseline", "keep", "nothing measurably faster")
    named = f"{label} (trial #{trial.number})"
    confirmed = report.confirmation and report.confirmation.comparison_of(trial.number)
    if confirmed and confirmed.measured:
        low, high = confirmed.ci_low, confirmed.ci_high
        interval = (
            f"{confirmed.ci_name} {low:.2f}-{high:.2f}x"
            if low is not None and high is not None
            else ""
        )
        return _card(named, f"{confirmed.ratio:.2f}x", _e(f"re-measured, {interval}"))
    base, own = report.baseline, trial.metric("throughput")
    ratio = own / base.metric("throughput") if base and own and base.metric("throughput") else None
    value = "-" if ratio is None else f"{ratio:.2f}x"
    return _card(named, value, "one measurement each: no interval")


def answer_cards(report: StudyReport) -> str:
    """The baseline's throughput, then (a) and (b) with their speedups, the share of the limit."""
    base, best, same = report.baseline, report.best, report.same_training
    cards = [
        _card("baseline" + (f" (trial #{base.number})" if base else ""), _throughput(base)),
        _speedup_card(report, "(a) same training", same),
    ]
    if best is not same:
        cards.append(_speedup_card(report, "(b) best overall", best))
    limit = best.metric("limit_efficiency") if best is not None else None
    if limit is not None:
        cards.append(_card("of this machine's limit", f"{limit:.0f}%", "best trial"))
    return f'<div class="cards">{"".join(cards)}</div>'


def _apply(changes: list[str]) -> str:
    return f"<p>Change to apply: <code>{_e(' '.join(changes))}</code></p>" if changes else ""


def answer_text(report: StudyReport) -> str:
    """(a) and (b), each with its change to apply; (b) with what it changes in the training."""
    same, best, base = report.same_training, report.best, report.baseline
    head = "<h3>(a) Same training: nothing to re-validate</h3>"
    parts = [f'<div class="answers"><div class="answer">{head}']
    if same is not None and same is base:
        evidence = f" ({_e(report.same_evidence)})" if report.same_evidence else ""
        parts.append(f"<p><b>{_e(KEEP_SAME)}</b>{evidence}.</p>")
    elif same is not None:
        parts.append(_apply(report.same_changes))
    else:
        why = f"Unknown: {report.training_unknown}" if report.training_unknown else "No answer"
        parts.append(f"<p>{_e(why)}.</p>")
    parts.append('</div><div class="answer"><h3>(b) Best overall</h3>')
    if best is not None and best is same:
        parts.append("<p>The same configuration: it keeps the training.</p>")
    elif best is not None and best is base:
        parts.append("<p>Nothing beat the baseline: keep it.</p>")
    else:
        parts.append(_apply(report.override_changes))
        if report.training_change:
            change = _e(report.training_change)
            parts.append(f'<p class="change"><b>Changes the training</b>: {change}</p>')
    parts.append("</div></div>")
    return "\n".join(parts)


def diagnosis_text(report: StudyReport) -> str:
    """Each side's diagnosis in one line, with what to try."""
    base, best = report.baseline, report.best
    parts = []
    for name, trial in (("Baseline", base), ("Best", best)):
        if trial is not None and (name == "Baseline" or trial is not base):
            d = trial.diagnosis
            parts.append(
                f"<p><b>{name} #{trial.number}: {_e(d.bottleneck.value)}</b>: {_e(d.summary)}"
                + (f"<br><small>try: {_e('; '.join(d.suggestions[:3]))}</small>" if d.suggestions else "")
                + "</p>"
            )  # fmt: skip
    return "\n".join(parts)


def trials_table(report: StudyReport) -> str:
    """Every trial, one row each; click a header to sort."""
    return to_html(tables.trials(report, None)[0], "trials")


def front_table(report: StudyReport) -> str:
    """Below the search's charts: the Pareto front, in noise groups where the objectives are
    gpuopt's metrics (what Optuna's front chart draws as trade-offs may be one configuration's
    noise)."""
    return to_html(tables.front(report), "front") if report.multi_objective else ""


def _chart(title: str, figure: Any, first: bool) -> str:
    """A plotly figure as a <div>: plotly.js inlined with the `first` one only."""
    import plotly.io as pio

    figure.update_layout(autosize=True, template="plotly_white")
    if figure.layout.height is None:
        figure.update_layout(height=CHART_HEIGHT)
    body = pio.to_html(
        figure,
        full_html=False,
        include_plotlyjs=first,
        config=PLOT_CONFIG,
        default_width="100%",
    )
    heading = f"<h3>{_e(title)}</h3>" if title else ""
    return f'<div class="chart">{heading}{body}</div>'


def render_page(
    search_figures: list[tuple[str, Any]] | None, report: StudyReport, text_html: str
) -> str:
    """The whole page; `search_figures` None means plotly is missing (a note replaces the charts)."""
    drawn: list[Any] = []

    def chart(title: str, figure: Any) -> str:
        drawn.append(figure)
        return _chart(title, figure, first=len(drawn) == 1)

    plotly = search_figures is not None
    speedup = speedup_figure(report) if plotly and report.ok_trials else None
    phases = phases_figure(report) if plotly else None
    no_plotly = f'<p class="note">{_e(PLOTLY_HINT)}: this page has no charts.</p>'
    sections = [
        f"<h1>gpuopt report: {_e(report.study_name)}</h1>",
        f'<p class="sub">{_e(_subtitle(report))}</p>',
        "<h2>The answer</h2>",
        answer_cards(report),
        answer_text(report),
        chart("", speedup) if speedup is not None else ("" if plotly else no_plotly),
        diagnosis_text(report),
        "<h2>Where the time goes</h2>",
        chart("Profiled step, baseline vs best", phases)
        if phases is not None
        else '<p class="note">No profiled trial: run the baseline or the best with '
        "<code>profile=on</code> (the sweeper profiles both by default).</p>",
        "<h2>The search</h2>",
    ]
    if not plotly:
        sections.append(no_plotly)
    elif not search_figures:
        sections.append('<p class="note">No completed ok trial: nothing to plot.</p>')
    else:
        divs = "".join(chart(title, figure) for title, figure in search_figures)
        sections.append(f'<div class="grid">{divs}</div>')
    sections.append(front_table(report))
    sections += [
        "<h2>Trials</h2>",
        trials_table(report),
        "<h2>Full text report</h2>",
        f"<details><summary>the terminal report</summary>{text_html}</details>",
    ]
    return _DOCUMENT.format(
        title=_e(report.study_name),
        style=_STYLE,
        body="\n".join(sections),
        script=_SORT_SCRIPT,
    )


def _subtitle(report: StudyReport) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in report.counts.items() if n)
    objectives = ", ".join(
        f"{o} ({d})" for o, d in zip(report.objectives, report.directions, strict=False)
    )
    hardware = report.hardware or {}
    machine = hardware.get("gpus") or hardware.get("cpu") or ""
    machine = ", ".join(machine) if isinstance(machine, list) else str(machine)
    return " · ".join(x for x in (objectives, counts, machine) if x)


_DOCUMENT = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gpuopt report: {title}</title>
<style>{style}</style>
</head>
<body>
<main>
{body}
</main>
<script>{script}</script>
</body>
</html>
"""


def plotly_available() -> bool:
    try:
        return importlib.util.find_spec("plotly") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken install
        return False


def write_html(
    path: str | Path, study: optuna.Study, report: StudyReport, text_html: str
) -> list[str]:
    """Write the report page; returns notes for the user (e.g. no plotly)."""
    notes: list[str] = []
    if plotly_available():
        search_figures: list[tuple[str, Any]] | None = figures(study, report)
    else:
        notes.append(PLOTLY_HINT)
        search_figures = None
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_page(search_figures, report, text_html), encoding="utf-8")
    return notes
