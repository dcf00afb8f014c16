"""The report page's plotly charts: the confirmed speedups with their intervals, the profiled step
of the baseline and the best, and the search (mostly optuna.visualization's)."""

from __future__ import annotations

from typing import Any

import optuna

from gpuopt.report.build import StudyReport
from gpuopt.report.evidence import PHASE_LABELS
from gpuopt.report.importance import importance_target, quiet_ped_anova
from gpuopt.study.storage import in_memory_copy

PHASE_COLOURS = {
    "data_wait": "#d62728",
    "h2d_copy": "#ff7f0e",
    "forward": "#1f77b4",
    "backward": "#17becf",
    "optimizer": "#9467bd",
    "other": "#bdbdbd",
}


def speedup_figure(report: StudyReport) -> Any:
    """Each confirmed candidate's speedup over the baseline as a point with its interval, the
    line at 1.0 meaning "no change"; without a confirmation, the one-measurement ratio alone."""
    import plotly.graph_objects as go

    confirmation = report.confirmation
    rows = [e for e in confirmation.comparisons if e.measured] if confirmation is not None else []
    figure = go.Figure()
    if rows:
        labels = [_answer_label(report, e.trial_number) for e in rows]
        ratios = [e.ratio for e in rows]
        upper = [(e.ci_high or e.ratio) - e.ratio for e in rows]
        lower = [e.ratio - (e.ci_low or e.ratio) for e in rows]
        figure.add_trace(
            go.Scatter(
                x=ratios,
                y=labels,
                mode="markers",
                marker={"size": 12, "color": "#1f77b4"},
                error_x={"type": "data", "symmetric": False, "array": upper, "arrayminus": lower},
                name=f"speedup, {rows[0].ci_name}",
                hovertemplate="%{x:.2f}x<extra>%{y}</extra>",
            )
        )
        title = f"Speedup over the baseline (re-measured, {rows[0].ci_name})"
    elif report.speedup is not None and report.best is not None:
        figure.add_trace(
            go.Scatter(
                x=[report.speedup],
                y=[f"trial #{report.best.number} (best)"],
                mode="markers",
                marker={"size": 12, "color": "#7f7f7f", "symbol": "diamond"},
                name="one measurement each: no interval",
            )
        )
        title = "Speedup over the baseline (one measurement each: no interval)"
    else:
        return None
    figure.add_vline(x=1.0, line_dash="dash", line_color="#888", annotation_text="no change")
    figure.update_layout(
        title={"text": title, "font": {"size": 14}},
        xaxis={"title": "throughput vs baseline (x)", "rangemode": "tozero"},
        height=max(200, 110 + 45 * max(1, len(rows))),
        margin={"l": 200, "r": 30, "t": 50, "b": 45},
        showlegend=False,
    )
    return figure


def _answer_label(report: StudyReport, number: int) -> str:
    """A confirmed candidate's row: its trial and which answer it is, (a) and/or (b)."""
    roles = [
        role
        for role, trial in (("a: same training", report.same_training), ("b: best", report.best))
        if trial is not None and trial.number == number
    ]
    return f"trial #{number}" + (f" ({', '.join(roles)})" if roles else "")


def phases_figure(report: StudyReport) -> Any:
    """Stacked horizontal bars: the profiled step of the baseline and the best, ms per phase."""
    import plotly.graph_objects as go

    base, best = report.baseline, report.best
    sides = [
        (f"{name} #{trial.number}", profile)
        for name, trial, profile in (
            ("baseline", base, base and base.profile),
            ("best", best, (best and best.profile) or report.best_profile),
        )
        if trial is not None and profile is not None and not (name == "best" and trial is base)
    ]
    if not sides:
        return None
    figure = go.Figure()
    for phase, label in PHASE_LABELS.items():
        ms = [1e3 * float((p.get("phases_s") or {}).get(phase) or 0.0) for _, p in sides]
        pct = [float((p.get("phases_pct") or {}).get(phase) or 0.0) for _, p in sides]
        figure.add_trace(
            go.Bar(
                y=[label for label, _ in sides],
                x=ms,
                orientation="h",
                name=label,
                marker_color=PHASE_COLOURS[phase],
                text=[f"{v:.0f}%" if v >= 4 else "" for v in pct],
                textposition="inside",
                customdata=pct,
                hovertemplate="%{x:.2f} ms (%{customdata:.1f}%)<extra>%{fullData.name}</extra>",
            )
        )
    figure.update_layout(
        barmode="stack",
        height=150 + 60 * len(sides),
        xaxis={"title": "ms per step (profiled window)"},
        yaxis={"autorange": "reversed"},
        legend={"orientation": "h", "y": -0.35, "traceorder": "normal"},
        margin={"l": 110, "r": 20, "t": 20, "b": 40},
    )
    return figure


def figures(study: optuna.Study, report: StudyReport) -> list[tuple[str, Any]]:
    """(title, plotly figure) pairs; needs plotly."""
    import plotly.graph_objects as go
    from optuna import visualization as vis

    if not report.ok_trials:
        return []
    # Only the ok trials: worst-case values of OOM/diverged ones would flatten every axis.
    ok_numbers = {t.number for t in report.ok_trials}
    ok = in_memory_copy(
        study, [t for t in study.get_trials(deepcopy=False) if t.number in ok_numbers]
    )
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
        with quiet_ped_anova():
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
        # Ticks at the batch sizes themselves: plotly's own on a log axis read "3 4 5 ... 100 2".
        sizes = sorted({p[0] for points in by_precision.values() for p in points})
        ticks = {"tickmode": "array", "tickvals": sizes, "ticktext": [f"{b:g}" for b in sizes]}
        scatter.update_layout(
            xaxis={"title": "loader.batch_size", "type": "log", **ticks},
            yaxis={"title": "throughput (samples/s)"},
            legend_title_text="precision",
        )
        result.append(("Throughput vs batch size, by precision", scatter))
    return result
