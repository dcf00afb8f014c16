"""The HTML report's search charts and its writer: the page itself (answer, where the time goes,
the search, the trials) is laid out by `gpuopt.report.page`.

Plots come from optuna.visualization (plotly); the page inlines plotly.js once, so the file has
no external script. Without plotly the page holds the numbers and tables and a note saying how to
get the charts.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import optuna

from gpuopt.report.page import PLOTLY_HINT, render_page
from gpuopt.report.summary import StudyReport, importance_target

__all__ = ["PLOTLY_HINT", "figures", "plotly_available", "write_html"]


def plotly_available() -> bool:
    try:
        return importlib.util.find_spec("plotly") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken install
        return False


def _ok_study(study: optuna.Study, report: StudyReport) -> optuna.Study:
    """An in-memory copy holding only the ok trials: worst-case values of OOM/diverged trials would
    flatten every axis and every importance."""
    ok_numbers = {t.number for t in report.ok_trials}
    copy = optuna.create_study(directions=study.directions)
    copy.add_trials([t for t in study.get_trials(deepcopy=False) if t.number in ok_numbers])
    return copy


def figures(study: optuna.Study, report: StudyReport) -> list[tuple[str, Any]]:
    """(title, plotly figure) pairs; needs plotly."""
    import plotly.graph_objects as go
    from optuna import visualization as vis

    if not report.ok_trials:
        return []
    ok = _ok_study(study, report)
    first = report.objectives[0]
    target = (
        {"target": (lambda t: t.values[0]), "target_name": first}
        if report.multi_objective
        else {"target_name": first}
    )
    result: list[tuple[str, Any]] = [
        (f"Optimization history ({first}, ok trials)", vis.plot_optimization_history(ok, **target))
    ]
    if report.multi_objective and len(report.objectives) <= 3:
        result.append(("Pareto front", vis.plot_pareto_front(ok, target_names=report.objectives)))
    for index, (name, importances) in enumerate(report.importances.items()):
        with warnings.catch_warnings():  # the sign is handled by importance_target (see summary.py)
            warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes")
            warnings.filterwarnings("ignore", message="Some regimes for parameter")
            figure = vis.plot_param_importances(
                ok,
                params=list(importances),
                target=importance_target(study.directions[index], index),
                target_name=name,
            )
        result.append((f"Parameter importances ({name})", figure))
    if any(t.params for t in report.ok_trials):
        result.append(("Parallel coordinates", vis.plot_parallel_coordinate(ok, **target)))

    scatter = go.Figure()
    by_precision: dict[str, list[tuple[float, float, int]]] = {}
    for trial in report.ok_trials:
        batch = (trial.config.get("loader") or {}).get("batch_size")
        throughput = trial.metric("throughput")
        if isinstance(batch, (int, float)) and throughput is not None:
            precision = str((trial.config.get("precision") or {}).get("mode", "?"))
            by_precision.setdefault(precision, []).append((batch, throughput, trial.number))
    for precision, points in sorted(by_precision.items()):
        scatter.add_trace(
            go.Scatter(
                x=[p[0] for p in points],
                y=[p[1] for p in points],
                mode="markers",
                name=precision,
                text=[f"trial #{p[2]}" for p in points],
            )
        )
    if by_precision:
        scatter.update_layout(
            xaxis={"title": "loader.batch_size", "type": "log"},
            yaxis={"title": "throughput (samples/s)"},
            legend_title_text="precision",
        )
        result.append(("Throughput vs batch size, by precision", scatter))
    return result


def write_html(
    path: str | Path, study: optuna.Study, report: StudyReport, text_html: str
) -> list[str]:
    """Write the report page (gpuopt.report.page); returns notes for the user (e.g. no plotly)."""
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
