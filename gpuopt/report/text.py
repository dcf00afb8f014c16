"""The terminal view of a `StudyReport` (rich tables); the HTML report embeds the same text."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gpuopt.core.fmt import limit_share
from gpuopt.core.fmt import metric as fmt
from gpuopt.core.metrics import columns, goals, unit
from gpuopt.report.build import COMPARED_METRICS, StudyReport, TrialView
from gpuopt.report.diagnose import Bottleneck, Diagnosis
from gpuopt.report.export_best import experiment_text
from gpuopt.report.noise_tables import GROUP_HEADER, best_noise_lines, front_table, group_cell
from gpuopt.study.answers import STRONG, WARNING, Shown, TwoAnswers, confirmation_lines, two_answers
from gpuopt.study.configs import flatten

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


def table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], justify: str = "right"
) -> Table:
    """A titled table: the first column names the row, the others justified by `justify`."""
    result = Table(title=title, title_justify="left")
    result.add_column(columns[0])
    for column in columns[1:]:
        result.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        result.add_row(*row)
    return result


def change(name: str, base: float | None, best: float | None) -> str:
    """Best vs baseline: points for percentages, else a ratio; green/red by the metric's goal."""
    if base is None or best is None:
        return ""
    if unit(name) == "%":
        delta = best - base
        text = f"{delta:+.1f} pts"
    else:
        if base == 0:
            return ""
        delta = best / base - 1.0
        text = f"x{best / base:.2f}"
    goal = goals().get(name)
    if goal is None or abs(delta) < 1e-12:
        return text
    better = (delta > 0) == (goal == "maximize")
    return f"[green]{text}[/]" if better else f"[red]{text}[/]"


def values_text(report: StudyReport, trial: TrialView) -> str:
    if trial.values is None:
        return "-"
    return ", ".join(
        f"{n} {fmt(n, v)}" for n, v in zip(report.objectives, trial.values, strict=False)
    )


def _params_text(trial: TrialView) -> str:
    """The sampled parameters (or the overrides of a trial without any), one `key=value` each."""
    if trial.params:
        return " ".join(f"{k}={v}" for k, v in trial.params.items())
    return " ".join(trial.overrides or [])


# Hardware facts shown in the header (flattened keys of the study's hardware attribute), in order;
# anything else recorded is listed after them.
HARDWARE_KEYS = (
    "id",
    "env.device",
    "env.device_name",
    "gpus",
    "cpu",
    "cpu_count",
    "env.cpus",
    "system",
    "machine",
)
MAX_HARDWARE_FACTS = 14


def header(report: StudyReport) -> Panel:
    lines = [
        f"[bold]Study[/] {escape(report.study_name)}   [dim]{escape(report.storage_url)}[/]",
        "Objectives: "
        + ", ".join(
            f"{o} ({d})" for o, d in zip(report.objectives, report.directions, strict=False)
        ),
    ]
    if report.hardware:
        # The probe's nested copies (env.fingerprint.*) and its search-space notes repeat or are
        # not hardware facts.
        facts = {
            k: v
            for k, v in flatten(report.hardware).items()
            if ".fingerprint." not in k
            and not k.startswith(("poor_choices", "dropped", "env.poor_choices"))
        }
        order = {k: i for i, k in enumerate(HARDWARE_KEYS)}
        keys = sorted(facts, key=lambda k: order.get(k, len(order)))
        shown = [f"{k}={_short(facts[k])}" for k in keys[:MAX_HARDWARE_FACTS]]
        lines.append("Hardware: " + escape("  ".join(shown)))
    else:
        lines.append("Hardware: not recorded")
    return Panel("\n".join(lines), title="gpuopt report", expand=False)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def counts_table(report: StudyReport) -> Table:
    table = Table(title="Trials by status", title_justify="left")
    for status in report.counts:
        table.add_column(status, justify="right", style=STATUS_STYLE.get(status))
    table.add_column("total", justify="right", style="bold")
    table.add_row(*(str(n) for n in report.counts.values()), str(sum(report.counts.values())))
    return table


def comparison_table(report: StudyReport) -> Table:
    best, base = report.best, report.baseline
    assert best is not None
    table = Table(title="Baseline vs best", title_justify="left")
    table.add_column("metric")
    if base is not None:
        table.add_column(
            f"baseline #{base.number}" + ("" if base.status == "ok" else f" ({base.status})"),
            justify="right",
        )
    table.add_column(f"best #{best.number}", justify="right", style="bold")
    if base is not None:
        table.add_column("change", justify="right")
    for name in dict.fromkeys([*report.objectives, *COMPARED_METRICS]):
        new, old = best.metric(name), base.metric(name) if base is not None else None
        if base is not None and (new is not None or old is not None):
            table.add_row(name, fmt(name, old), fmt(name, new), change(name, old, new))
        elif new is not None:
            table.add_row(name, fmt(name, new))
    return table


def speedup_lines(report: StudyReport) -> list[str]:
    lines: list[str] = []
    if report.baseline is None:
        lines.append("No baseline trial recorded: speedup unknown.")
    elif report.baseline.status != "ok":
        lines.append(f"The baseline ended as {report.baseline.status}: speedup unknown.")
    elif report.best is report.baseline:
        pass  # nothing beat it: confirmation_lines (or the change section) says so
    elif report.speedup is not None and not report.confirmed:
        # one reading each and no confirmation: a ratio to read, never an answer's speedup
        lines.append(
            f"Not confirmed: trial #{report.best.number} read {report.speedup:.2f}x the "  # type: ignore[union-attr]
            f"baseline's throughput (#{report.baseline.number}), one measurement each: no "
            "answer until re-measured"
        )
    for label, trial in (("baseline", report.baseline), ("best", report.best)):
        share = (
            limit_share(trial.attrs, report.highest_limit)
            if trial is not None and trial.status == "ok"
            else None
        )
        if share and not (label == "best" and trial is report.baseline):
            lines.append(f"The {label} (trial #{trial.number}) is at {escape(share)}.")  # type: ignore[union-attr]
    lines += confirmation_section(report)
    return lines


def confirmation_section(report: StudyReport) -> list[str]:
    """The sweeper's end-of-sweep re-measurement, in the sweep summary's words
    (gpuopt.study.answers)."""
    confirmation = report.confirmation
    if confirmation is None and report.unread_confirmation is not None:
        return [f"Confirmation (unrecognised format): {escape(_short(report.unread_confirmation))}"]
    if confirmation is None:
        return [
            (
                "[dim]No confirmation recorded (the sweeper's end-of-sweep re-measurement of the "
                "baseline vs the top candidates): one measurement drifts 4-14% between "
                "processes.[/]"
            )
        ]
    best_number = report.best.number if report.best is not None else None
    style = {STRONG: "bold", WARNING: "yellow"}
    return [
        f"[{style[line.emphasis]}]{escape(line.text)}[/]" if line.emphasis else escape(line.text)
        for line in confirmation_lines(confirmation, best_number)
    ]


def two_answers_lines(report: StudyReport) -> list[str]:
    """The two answers in the sweep summary's words; the LR scaling and loss drift of the best."""
    best, same = report.best, report.same_training
    if best is None or report.baseline is None:
        return []
    held = f"global batch {report.global_batch}" if report.global_batch else "the same batch"

    def shown(trial: TrialView, apply: list[str]) -> Shown:
        return Shown(trial.number, f"({values_text(report, trial)})", tuple(apply))

    said = two_answers(
        TwoAnswers(
            held,
            shown(best, report.override_changes),
            None if same is None else shown(same, report.same_changes),
            report.baseline.number,
            report.confirmation,
            report.training_change,
            report.training_unknown,
            report.same_evidence,
        )
    )
    lines = [f"[bold]Two answers[/]{escape(said[0][len('two answers') :])}"]
    style = {"changes the training": "yellow", "change to apply": "bold"}
    for line in said[1:]:
        tag = next((v for k, v in style.items() if line.lstrip().startswith(k)), None)
        lines.append(f"[{tag}]{escape(line)}[/]" if tag else escape(line))
    optimizer = best.config.get("optimizer") or {}
    if optimizer.get("lr_scaling") not in (None, "none"):
        lines.append(
            f"  LR scaling ({optimizer['lr_scaling']}, reference batch "
            f"{optimizer.get('reference_batch')}): lr x{best.metric('lr_scale') or 1.0:.3g} in "
            f"trial #{best.number}"
        )
    drift = best.metric("loss_drift")
    if drift is not None:
        lines.append(f"  numerics guard: loss_drift {drift:.3g} for trial #{best.number}")
    return lines


def change_section(report: StudyReport) -> Group:
    best = report.best
    assert best is not None
    if report.baseline is best:
        return Group(Text("The baseline is the best trial: nothing to change."))
    parts: list[Any] = []
    if best.overrides is None:
        parts.append(Text("The best trial has no recorded overrides; see the config diff."))
    elif not report.override_changes and not report.reverted_overrides:
        parts.append(Text("The best trial uses the baseline's overrides."))
    else:
        if report.override_changes:
            parts.append(
                Text.from_markup(
                    "Overrides: [bold]" + escape(" ".join(report.override_changes)) + "[/]"
                )
            )
        if report.reverted_overrides:
            parts.append(Text("Drop from the baseline: " + " ".join(report.reverted_overrides)))
    if report.config_changes:
        table = Table(title="Resolved config: keys that differ", title_justify="left")
        table.add_column("key")
        table.add_column("baseline", justify="right")
        table.add_column("best", justify="right", style="bold")
        for item in report.config_changes:
            table.add_row(item.key, escape(_short(item.baseline)), escape(_short(item.best)))
        parts.append(table)
    if report.override_changes:
        yaml_text = experiment_text(report.override_changes)
        parts.append(Text("As a config (paste into a YAML file, or use --export-best PATH):"))
        parts.append(Text(yaml_text.rstrip(), style="cyan"))
    return Group(*parts)


def diagnosis_panel(label: str, diagnosis: Diagnosis) -> Panel:
    lines = [f"[bold]{diagnosis.bottleneck.value}[/]: {escape(diagnosis.summary)}"]
    lines += [f"  - {escape(e)}" for e in diagnosis.evidence]
    if diagnosis.suggestions:
        lines.append("Try:")
        lines += [f"  - {escape(s)}" for s in diagnosis.suggestions]
    return Panel(
        "\n".join(lines),
        title=f"Bottleneck: {label}",
        title_align="left",
        expand=False,
    )


def trials_table(report: StudyReport, limit: int | None) -> tuple[Table, int]:
    """The ok trials best first (by the first objective), then the rest by number; returns the
    table and how many trials it leaves out."""
    maximize = report.directions[0] == "maximize"
    ranked = sorted(report.ok_trials, key=lambda t: t.values[0], reverse=maximize)  # type: ignore[index]
    ranked += [t for t in report.trials if t not in ranked]
    shown = list(ranked if limit is None else ranked[:limit])
    if report.baseline is not None and report.baseline not in shown:
        shown.append(report.baseline)
    units = ", ".join(f"{n} in {unit(n)}" for n in report.objectives if unit(n) not in ("", "%"))
    grouped = report.best is not None and group_cell(report, report.best) is not None
    noise = (
        f"; {GROUP_HEADER} = noise group: one number, no measurable difference" if grouped else ""
    )
    table = Table(
        title="Trials (best first; B = baseline, * = best"
        + (f"; {units}" if units else "")
        + noise
        + ")",
        title_justify="left",
    )
    # Diagnostic metrics next to the objectives, unless already shown as one.
    extra = [(name, column) for name, column in columns("column") if name not in report.objectives]
    group = [GROUP_HEADER] if grouped else []
    for header in ("#", *group, *report.objectives, *(column.header for _, column in extra)):
        table.add_column(header, justify="right", no_wrap=True)
    # ok trials: their bottleneck; the others: how they ended (oom, error, running, ...)
    table.add_column("bottleneck", min_width=len("bottleneck"))
    # One column per sampled parameter (headed by its last dotted part) while they fit; else, and
    # for trials without sampled parameters, one folded column of key=value.
    param_names = list(dict.fromkeys(k for t in report.trials for k in t.params))
    as_columns = 0 < len(param_names) <= MAX_PARAM_COLUMNS
    if as_columns:
        for name in param_names:
            header = name.rsplit(".", 1)[-1]
            table.add_column(header, overflow="fold", min_width=len(header))
    else:
        table.add_column("parameters", overflow="fold", min_width=16)
    for trial in shown:
        ok = trial.status == "ok"
        values = trial.values if ok and trial.values else [None] * len(report.objectives)
        mark = " B" if trial.baseline else ""
        mark += " *" if trial is report.best else ""
        verdict = (
            BOTTLENECK_SHORT[trial.diagnosis.bottleneck]
            if ok
            else f"[{STATUS_STYLE.get(trial.status, 'white')}]{trial.status}[/]"
        )
        if as_columns:
            params = [escape(str(trial.params.get(n, "-"))) for n in param_names]
        else:
            params = [escape(_params_text(trial))]
        table.add_row(
            f"{trial.number}{mark}",
            *([group_cell(report, trial) or ""] if grouped else []),
            *(fmt(n, v, unit=False) for n, v in zip(report.objectives, values, strict=False)),
            *(fmt(name, trial.metric(name)) for name, _ in extra),
            verdict,
            *params,
        )
    return table, len(ranked) - len(shown)


def importance_section(report: StudyReport) -> Any:
    if not report.importances:
        return Text(report.importance_note or "parameter importances unavailable", style="dim")
    imps = report.importances.values()
    return table(
        "Which parameters mattered (PED-ANOVA, ok trials)",
        ["parameter", *report.importances],
        [(p, *(f"{imp.get(p, 0.0):.2f}" for imp in imps)) for p in next(iter(imps))],
    )


def render(report: StudyReport, console: Console, limit: int | None = 15) -> None:
    """Print the whole report."""
    console.print(header(report))
    console.print(counts_table(report))
    if report.best is None:
        running = report.counts.get("running", 0)
        console.print(
            "[bold yellow]No completed ok trial in this study yet[/]"
            + (f" ({running} running)." if running else ".")
        )
        if report.trials:
            table, _ = trials_table(report, limit)
            console.print(table)
        return
    console.print(comparison_table(report))
    # both answers first, then the confirmation
    for line in two_answers_lines(report) + speedup_lines(report) + best_noise_lines(report):
        console.print(line)
    if report.multi_objective:
        console.print(front_table(report, _params_text))
        confirmed = report.confirmation is not None and report.confirmation.configs
        how = (
            "the confirmation round's winner (above)"
            if confirmed
            else f"the Pareto trial with the best {report.objectives[0]}"
        )
        console.print(f"[dim]Best = {how}.[/]")
    console.rule("The change to apply")
    console.print(change_section(report))
    console.rule("Bottlenecks")
    console.print(diagnosis_panel(f"best (#{report.best.number})", report.best.diagnosis))
    if report.baseline is not None and report.baseline is not report.best:
        base = report.baseline
        console.print(diagnosis_panel(f"baseline (#{base.number})", base.diagnosis))
    table, hidden = trials_table(report, limit)
    console.print(table)
    if hidden > 0:
        console.print(f"[dim]{hidden} more trials not shown (--all shows every trial).[/]")
    console.print(importance_section(report))


def trial_detail(report: StudyReport, trial: TrialView) -> Group:
    """What is recorded about one trial: status, values, overrides, diagnosis, reason, warnings."""
    lines = [
        f"[bold]Trial #{trial.number}[/] ({trial.status})"
        + (" - the baseline" if trial.baseline else "")
    ]
    if trial.values is not None and trial.status == "ok":
        lines.append("Values: " + values_text(report, trial))
    lines.append("Overrides: " + escape(" ".join(trial.overrides or []) or "(none recorded)"))
    for key in ("run_dir", "reason"):
        if trial.attrs.get(key):
            lines.append(f"{key}: {escape(str(trial.attrs[key]))}")
    for warning in trial.attrs.get("warnings") or []:
        lines.append(f"[yellow]warning:[/] {escape(str(warning))}")
    return Group(
        Text.from_markup("\n".join(lines)),
        diagnosis_panel(f"trial (#{trial.number})", trial.diagnosis),
    )
