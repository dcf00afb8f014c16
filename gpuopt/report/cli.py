"""`python -m gpuopt.report`: list studies, report one, write HTML, export the best config."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import optuna
from rich.console import Console
from rich.table import Table

from gpuopt.report.build import ReportError, StudyReport, build_report, config_diff
from gpuopt.report.export_best import compose_experiment, conf_groups
from gpuopt.report.page import PLOTLY_HINT, plotly_available, write_html
from gpuopt.report.tables import rows_table, to_rich
from gpuopt.report.text import render, trial_detail, values_text
from gpuopt.study.artifact_store import store_page
from gpuopt.study.experiment import overrides_to_experiment, write_experiment
from gpuopt.study.storage import (
    StorageError,
    StudyEntry,
    default_url,
    list_studies,
    load_study,
    open_existing,
)

HTML_WIDTH = 150  # characters per line of the text report embedded in the HTML page
PIPE_WIDTH = 150  # characters per line when stdout is not a terminal (files, CI logs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gpuopt.report",
        description="Review a gpuopt study: status counts, baseline vs best, the change to apply, "
        "bottlenecks, parameter importances; optional HTML plots and best-config export.",
    )
    parser.add_argument(
        "--storage",
        default=None,
        help=f"Optuna storage URL (default: {default_url()}, from GPUOPT_OUTPUT_DIR or ./outputs)",
    )
    parser.add_argument("--study", default=None, help="study name (default: the latest study)")
    parser.add_argument(
        "--html", metavar="PATH", help="also write a self-contained HTML report with plots"
    )
    parser.add_argument(
        "--export-best",
        metavar="PATH",
        help="write the best configuration as a Hydra experiment config "
        "(e.g. conf/experiment/best_NAME.yaml)",
    )
    parser.add_argument(
        "--top", type=int, default=15, help="trials shown in the trials table (default 15)"
    )
    parser.add_argument("--all", action="store_true", help="show every trial")
    parser.add_argument(
        "--trial",
        type=int,
        metavar="N",
        help="also show trial N in detail: overrides, diagnosis with evidence, reason",
    )
    parser.add_argument("--list", action="store_true", help="only list the studies in the storage")
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="two trials side by side (config diff, metrics, phase breakdowns): trial numbers "
        "of the study, or paths to a run's result.json (or its run directory)",
    )

    def one_line_error(message: str) -> None:  # argparse's usage block would be many lines
        print(
            f"gpuopt.report: error: {message}; see python -m gpuopt.report --help", file=sys.stderr
        )
        sys.exit(2)

    parser.error = one_line_error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    check_arguments(args)
    return args


def check_arguments(args: argparse.Namespace) -> None:
    """Values and output paths, before any storage is opened or report built: one line, exit 2."""
    from gpuopt.core.checks import check_writable_path
    from gpuopt.core.errors import ConfigError

    try:
        if args.top < 1:
            raise ConfigError("--top", args.top, "an integer >= 1 (or --all)")
        if args.trial is not None and args.trial < 0:
            raise ConfigError("--trial", args.trial, "a trial number >= 0")
        same = args.html and args.export_best
        if same and Path(args.html).resolve() == Path(args.export_best).resolve():
            raise ConfigError("--export-best", args.export_best, "a path other than --html's")
        if args.html:
            check_writable_path("--html", args.html)
        if args.export_best:
            check_writable_path("--export-best", args.export_best)
    except ConfigError as exc:
        print(
            f"gpuopt.report: error: invalid argument {exc.key}={exc.value!r}; "
            f"allowed: {exc.allowed}",
            file=sys.stderr,
        )
        sys.exit(2)


def studies_table(studies: list[StudyEntry], current: str | None) -> Table:
    return to_rich(
        rows_table(
            "Studies",
            ("study", "trials", "directions", "started"),
            [
                (
                    e.name + (" <" if e.name == current else ""),
                    str(e.n_trials),
                    ", ".join(e.directions),
                    e.started.strftime("%Y-%m-%d %H:%M") if e.started else "-",
                )
                for e in studies
            ],
            numbers=False,
        )
    )


def run_command_for(path: Path) -> str:
    """How to run an exported experiment written to `path`."""
    if path.parent.name != "experiment":
        return (
            f"put it in a folder named experiment/ (e.g. conf/experiment/{path.name}), then: "
            f"python -m gpuopt.run --config-dir DIR_ABOVE_IT +experiment={path.stem}"
        )
    conf_dir = path.parent.parent  # as given: a relative path stays relative to where you are
    import gpuopt.conf

    if conf_dir.resolve() == Path(gpuopt.conf.__file__).parent.resolve():
        return f"python -m gpuopt.run +experiment={path.stem}"
    return f"python -m gpuopt.run --config-dir {conf_dir} +experiment={path.stem}"


def export_best(report: StudyReport, path: Path, console: Console) -> None:
    best = report.best
    if best is None:
        raise ReportError(f"study {report.study_name!r} has no completed ok trial to export")
    if best.overrides is None:
        raise ReportError(f"trial #{best.number} has no recorded overrides: cannot export it")
    values = values_text(report, best)
    header = [f"Best configuration of study {report.study_name}: trial #{best.number} ({values})"]
    if report.speedup is not None:
        header.append(
            f"{report.speedup:.2f}x the baseline's throughput (trial #{report.baseline.number})"
        )  # type: ignore[union-attr]
    header.append(f"Run it: {run_command_for(path)}")
    body, skipped = overrides_to_experiment(best.overrides, conf_groups())
    write_experiment(path, body, header)
    console.print(f"Wrote {path}\n  {run_command_for(path)}")
    if skipped:
        console.print(
            f"[yellow]Left out (not expressible in a config file): {' '.join(skipped)}[/]"
        )
    text = path.read_text()
    if not best.config:
        console.print("[yellow]Not verified: the trial has no recorded resolved config.[/]")
        return
    try:
        composed = compose_experiment(text, name=path.stem)
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        console.print(
            "[yellow]Not verified: composing the export failed: "
            f"{type(exc).__name__}: {first_line}[/]"
        )
        return
    mismatches = config_diff(best.config, composed)
    if mismatches:
        console.print(
            "[bold yellow]Warning: the export composes differently from "
            f"trial #{best.number}'s config:[/]"
        )
        for item in mismatches:
            console.print(f"  {item.key}: trial {item.baseline!r}, export {item.best!r}")
    else:
        console.print(f"Verified: the export composes to trial #{best.number}'s resolved config.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Piped output (a file, a CI log) gets a fixed width wide enough for the trials table.
    console = Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH)
    url = args.storage or default_url()
    # Importances and plots are computed quietly; Optuna's INFO logs would drown the report.
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        if args.compare:  # the study is read only when a side is a trial number
            from gpuopt.report.compare import compare, render_comparison, resolve_side

            report = None
            if any(r.isdigit() for r in args.compare):
                report = build_report(load_study(open_existing(url), url, args.study), url)
            a, b = (resolve_side(r, report) for r in args.compare)
            render_comparison(compare(a, b), console)
            return 0
        storage = open_existing(url)
        studies = list_studies(storage)
        if args.list:
            console.print(studies_table(studies, None))
            return 0
        study = load_study(storage, url, args.study)
        if args.study is None:
            console.print(studies_table(studies, study.study_name))
        report = build_report(study, url)
        limit = None if args.all else args.top
        render(report, console, limit)
        if args.trial is not None:
            console.print(trial_detail(report, report.trial(args.trial)))
        if args.html:
            recorder = Console(
                record=True, width=HTML_WIDTH, file=io.StringIO(), force_terminal=True
            )
            render(report, recorder, limit)
            text_html = recorder.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
            notes = write_html(args.html, study, report, text_html)
            stored = store_page(study, args.html)  # beside the trials' files (optuna-dashboard)
            notes += [stored] if stored else []
            console.print(f"Wrote {args.html}" + "".join(f" ({n})" for n in notes))
        elif not plotly_available():
            console.print(f"[dim]Note: {PLOTLY_HINT} (for --html).[/]")
        if args.export_best:
            export_best(report, Path(args.export_best), console)
    except (ReportError, StorageError) as exc:
        print(f"gpuopt.report: error: {exc}", file=sys.stderr)
        return 2
    return 0
