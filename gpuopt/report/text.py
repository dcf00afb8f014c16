"""The terminal view of a `StudyReport` (rich tables); the HTML report embeds the same text."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.text import Text

from gpuopt.core.fmt import limit_share
from gpuopt.core.fmt import metric as fmt
from gpuopt.report import tables
from gpuopt.report.build import StudyReport, TrialView
from gpuopt.report.diagnose import Diagnosis
from gpuopt.report.export_best import experiment_text
from gpuopt.report.tables import short, to_rich
from gpuopt.study.answers import STRONG, WARNING, Shown, TwoAnswers, confirmation_lines, two_answers
from gpuopt.study.configs import flatten
from gpuopt.study.noise import best_noise_lines


def values_text(report: StudyReport, trial: TrialView) -> str:
    if trial.values is None:
        return "-"
    return ", ".join(
        f"{n} {fmt(n, v)}" for n, v in zip(report.objectives, trial.values, strict=False)
    )


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
        shown = [f"{k}={short(facts[k])}" for k in keys[:MAX_HARDWARE_FACTS]]
        lines.append("Hardware: " + escape("  ".join(shown)))
    else:
        lines.append("Hardware: not recorded")
    return Panel("\n".join(lines), title="gpuopt report", expand=False)


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
        return [f"Confirmation (unrecognised format): {escape(short(report.unread_confirmation))}"]
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


def noise_lines(report: StudyReport) -> list[str]:
    """What noise says of the best pick (gpuopt.study.noise), as sentences."""
    noise, best, base = report.noise, report.best, report.baseline
    if noise is None or best is None:
        return []
    base_number = base.number if base is not None else None
    said = best_noise_lines(noise, best.number, base_number, report.confirmation)
    return [escape(line[0].upper() + line[1:] + ".") for line in said]


def two_answers_lines(report: StudyReport) -> list[str]:
    """The two answers in the sweep summary's words; the LR scaling and loss drift of the best."""
    best, same = report.best, report.same_training
    if best is None or report.baseline is None:
        return []
    held = (
        f"global batch {report.global_batch}"
        if report.global_batch
        else "the baseline's global batch"
    )

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
        parts.append(to_rich(tables.config_changes(report)))
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


def render(report: StudyReport, console: Console, limit: int | None = 15) -> None:
    """Print the whole report."""
    console.print(header(report))
    console.print(to_rich(tables.counts(report)))
    if report.best is None:
        running = report.counts.get("running", 0)
        console.print(
            "[bold yellow]No completed ok trial in this study yet[/]"
            + (f" ({running} running)." if running else ".")
        )
        if report.trials:
            console.print(to_rich(tables.trials(report, limit)[0]))
        return
    console.print(to_rich(tables.comparison(report)))
    # both answers first, then the confirmation
    for line in two_answers_lines(report) + speedup_lines(report) + noise_lines(report):
        console.print(line)
    if report.multi_objective:
        console.print(to_rich(tables.front(report)))
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
    table, hidden = tables.trials(report, limit)
    console.print(to_rich(table))
    if hidden > 0:
        console.print(f"[dim]{hidden} more trials not shown (--all shows every trial).[/]")
    if report.importances:
        console.print(to_rich(tables.importances(report)))
    else:
        note = report.importance_note or "parameter importances unavailable"
        console.print(Text(note, style="dim"))


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
