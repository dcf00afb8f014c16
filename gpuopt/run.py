"""`python -m gpuopt.run [overrides]`: measure one training configuration (or, with -m, a sweep).

One route per trial: the composed config -> `gpuopt.trial.prepare.prepare_trial` (the one
validation) -> `gpuopt.engines.registry.run_trial(spec, device)` -> one `TrialResult`: a table,
result.json in the run directory, and the return value for the sweeper. torch is imported only
inside functions: the sweeper process imports this module too and must stay light.

Bad input ends the command with one line on stderr and exit status 2, before anything is created:
`cli()` parses the arguments itself (argparse's usage block would be many lines), turns Hydra's
composition errors into `ConfigError`s (Hydra raises them to us under HYDRA_FULL_ERROR, which
`cli()` sets only until the job starts), and the `ValidateBeforeRun` callback prepares the trial
in `on_run_start`, which Hydra calls before it creates the run directory.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from gpuopt.core._compat import hydra_args_parser, report_as_hydra
from gpuopt.core.checks import resolved_or_written
from gpuopt.core.errors import ConfigError, config_error_from_hydra
from gpuopt.core.fmt import fixed, limit_share
from gpuopt.core.metrics import Metrics, run_rows
from gpuopt.core.result import Status, TrialResult
from gpuopt.core.secrets import mask_secrets
from gpuopt.core.spec import register_schemas
from gpuopt.engines.registry import run_trial
from gpuopt.study.noise import SPREAD_HINT
from gpuopt.trial.prepare import PreparedTrial, prepare_trial

if TYPE_CHECKING:
    from rich.console import Console

RESULT_FILE = "result.json"

# Before @hydra.main composes: the defaults list starts with the schema `gpuopt_schema`.
register_schemas()


def _as_written(cfg: DictConfig) -> dict[str, Any]:
    """The config unresolved, without Hydra's node (the callback sees it, the task does not)."""
    container = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(container, dict)
    return {key: value for key, value in container.items() if key != "hydra"}


# What the callback prepared for the task it runs before (the same process), keyed by the config
# as written.
_prepared: tuple[dict[str, Any], PreparedTrial] | None = None


def run_config(
    cfg: DictConfig, output_dir: Path | None = None, multirun: bool = False
) -> TrialResult:
    """Measure one composed config; save result.json into `output_dir` if given. A ConfigError
    exits (single run) or becomes an `error` result (multirun: one bad trial must not end a sweep).
    """
    global _prepared
    taken, _prepared = _prepared, None
    prepared = taken[1] if taken is not None and taken[0] == _as_written(cfg) else None
    if prepared is None:
        try:
            prepared = prepare_trial(cfg)
        except ConfigError as exc:
            if not multirun:
                fail(exc)
            result = TrialResult(
                status=Status.ERROR, reason=str(exc), config=resolved_or_written(cfg)
            )
            if output_dir is not None:
                result.save(output_dir / RESULT_FILE)
            return result

    result = run_trial(prepared.spec, device=prepared.device)
    result.warnings = prepared.warnings + result.warnings
    result.config = resolved_or_written(cfg)
    with_run_spread(result)
    if output_dir is not None:
        result.save(output_dir / RESULT_FILE)
    if not multirun:
        print_result(result, output_dir / RESULT_FILE if output_dir is not None else None)
    return result


# The one target Hydra itself instantiates from gpuopt's config (`hydra.callbacks`); gpuopt's own
# instantiate() calls pass their own whitelists.
@hydra.main(
    config_path="pkg://gpuopt.conf",
    config_name="config",
    execution_whitelist=("gpuopt.run.ValidateBeforeRun",),
)
def main(cfg: DictConfig) -> TrialResult:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return run_config(cfg)
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return run_config(cfg, Path(output_dir) if output_dir else None, multirun)


def print_result(
    result: TrialResult, saved_to: Path | None = None, console: Console | None = None
) -> None:
    """One trial's result as a table, then its reason and warnings below it, where a long line
    is not cut to a column."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    colour = {"ok": "green", "oom": "yellow", "diverged": "yellow"}.get(result.status.value, "red")
    table = Table(
        title=f"gpuopt trial: [{colour}]{result.status.value}[/{colour}]", show_header=False
    )
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_column("note")
    for row in _result_rows(result):
        table.add_row(*(escape(cell) for cell in row))
    console = console or Console()
    console.print(table)
    if result.reason:
        # escaped: a reason quotes library messages, e.g. gloo's "[.../unbound_buffer.cc:78]"
        console.print(f"[{colour}]reason:[/{colour}] {escape(result.reason)}")
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    if saved_to is not None:
        console.print(f"result: {saved_to}")


def _result_rows(result: TrialResult) -> list[tuple[str, str, str]]:
    """The catalogue's rows (gpuopt.core.metrics) with the notes and cells below. What not every
    trial measures (a user step has no limit, one process no ranks) has a row only where it was
    measured."""
    rows = []
    m = result.metrics
    for metric, row in run_rows():
        value = getattr(m, metric.name)
        note_of, cell_of = (globals().get(f"_{kind}_{metric.name}") for kind in ("note", "cell"))
        note = note_of(m) if note_of else row.note
        if not row.optional or (value is not None and note is not None):
            if cell_of:
                cell = cell_of(result)
            else:
                unit = metric.unit if row.unit is None else row.unit
                cell = fixed(value, f" {unit}" if unit else "", row.digits)
            rows.append((row.label, cell, note or ""))
        if metric.name == "cpu_steal_pct":  # the device's row (not a metric) follows it
            env = result.env
            rows.append(("device", str(env.get("device_name", "-")), str(env.get("device", ""))))
    return rows


def with_run_spread(result: TrialResult) -> None:
    """The run-to-run spread of this workload on this machine (gpuopt.core.machine_cache, which
    scripts/bench_noise.py fills) and, in words, what each interval covers: the window's CI is
    over its own steps, while fresh processes of one configuration read 4-25% apart on a 2-core
    CPU, which only a measurement across processes can say."""
    from gpuopt.core.machine_cache import read_spread

    m = result.metrics
    if not result.ok or m.throughput is None:
        return
    spread = read_spread(result.env, result.config)
    window = (
        "throughput_ci: not measured"
        if m.throughput_ci is None
        else f"throughput_ci: 95% over the {m.timed_steps} steps of this one window, not "
        "between processes"
    )
    if spread is None:
        m.intervals = (
            f"{window}; run to run: not known for this machine and workload ({SPREAD_HINT})"
        )
        return
    m.run_spread, m.run_spread_runs = spread.cv, spread.runs
    by = " ".join(part for part in (spread.by, spread.date) if part)
    m.intervals = (
        f"{window}; run to run: {spread.cv * 100:.1f}% (coefficient of variation between "
        f"{spread.runs} fresh processes, {by})"
    )


# The notes (None: no row) and cells that combine several metrics: `_note_<metric>` and
# `_cell_<metric>` for the metric of their row, beside the catalogue rather than a table of its names.
def _note_throughput(m: Metrics) -> str:
    if m.throughput_ci is None:
        return ""
    return f"± {m.throughput_ci * 100:.1f}% (95% CI over this window's steps)"


def _note_run_spread(m: Metrics) -> str:
    if m.run_spread is None:  # the command that measures it (result.json's `intervals` says more)
        return "scripts/bench_noise.py --spread-only" if m.intervals else ""
    return f"CV between {m.run_spread_runs} fresh processes (scripts/bench_noise.py)"


def _cell_run_spread(r: TrialResult) -> str:
    spread = r.metrics.run_spread
    if spread is None:
        return "not known" if r.metrics.intervals else "-"
    return f"± {spread * 100:.1f}%"


def _note_throughput_amortized(m: Metrics) -> str:
    boundary = fixed(m.epoch_overhead_s, " s", 2)
    return f"over {fixed(m.epoch_steps)}-step epochs (boundary {boundary})"


def _note_step_time_ms(m: Metrics) -> str:
    p10, p90 = fixed(m.step_time_p10_ms, " ms", 3), fixed(m.step_time_p90_ms, " ms", 3)
    return f"p10 {p10}, p90 {p90}, cv {fixed(m.step_time_cv, '', 3)}"


def _note_limit_throughput(m: Metrics) -> str | None:
    share = limit_share(dataclasses.asdict(m))  # the sweep summary's and the report's words
    return None if share is None else f"at {share}"


def _note_timed_steps(m: Metrics) -> str:
    return f"stopped: {m.stop_reason or '-'}"


def _note_world_size(m: Metrics) -> str:
    return (
        f"straggler rank {fixed(m.straggler_rank)}, step time spread "
        f"{fixed(m.step_time_spread, ' %', 1)}, peak memory spread "
        f"{fixed(m.peak_memory_spread_mb, ' MB', 1)}"
    )


def _note_comm_share(m: Metrics) -> str:
    exposed, overlapped = fixed(m.comm_exposed, " %", 1), fixed(m.comm_overlapped, " %", 1)
    return f"exposed {exposed}, overlapped {overlapped} of the profiled step (mean over ranks)"


def _cell_timed_steps(r: TrialResult) -> str:
    return f"{fixed(r.metrics.timed_steps)} steps in {fixed(r.metrics.timed_seconds, ' s', 2)}"


def _cell_world_size(r: TrialResult) -> str:
    return f"{r.metrics.world_size} ({r.env.get('backend', '-')})"


# --- bad input: one line on stderr, exit status 2, nothing created --------------------------------

FULL_ERROR_ENV = "HYDRA_FULL_ERROR"
# The user's own HYDRA_FULL_ERROR, held while `cli()` has set its own (until the job starts): a
# process that did not come through `cli()` (a launcher's job, `main` called directly) keeps its own.
_user_full_error: tuple[str | None] | None = None


def fail(error: ConfigError | str) -> None:
    """The one line for bad input, then exit status 2; secrets masked (an unquoted storage URL
    with `?password=...` fails Hydra's override grammar, whose error line quotes it)."""
    line = mask_secrets(" ".join(str(error).split()))
    print(f"gpuopt: {line}", file=sys.stderr)
    sys.exit(2)


def _restore_full_error() -> None:
    """HYDRA_FULL_ERROR back as the user set it; a no-op where `cli()` did not set it."""
    if _user_full_error is None:
        return
    (user,) = _user_full_error
    if user is None:
        os.environ.pop(FULL_ERROR_ENV, None)
    else:
        os.environ[FULL_ERROR_ENV] = user


def check_before_run(config: DictConfig) -> None:
    """Prepare the trial before Hydra creates its run directory, for the task to measure."""
    global _prepared
    _prepared = (_as_written(config), prepare_trial(config, run_dir=True))


class ValidateBeforeRun(Callback):
    """Hydra callback (conf/config.yaml): `on_run_start` runs before the run directory exists."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        _restore_full_error()
        HydraConfig.instance().set_config(config)  # ${hydra:...} resolves, as in the job
        try:
            check_before_run(config)
        except ConfigError as exc:
            fail(exc)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _restore_full_error()  # the sweeper validates the composed config itself


def cli() -> None:
    """`python -m gpuopt.run`: Hydra's main, with bad input reported as one line and exit 2."""
    global _user_full_error
    parser = hydra_args_parser()  # Hydra's own, failing with one line instead of its usage block
    parser.error = lambda message: fail(  # type: ignore[method-assign]
        f"invalid argument: {message}; allowed: see python -m gpuopt.run --help"
    )
    args = parser.parse_intermixed_args(sys.argv[1:])
    _user_full_error = (user := os.environ.get(FULL_ERROR_ENV),)
    os.environ[FULL_ERROR_ENV] = "1"  # until the job starts, Hydra raises its errors to us
    try:
        main()
    except Exception as exc:
        _restore_full_error()
        error = (
            None
            if user == "1"  # Hydra's own test: its full traceback only for "1"
            else config_error_from_hydra(exc, list(args.overrides), bool(args.multirun))
        )
        if error is None:
            report_as_hydra(exc)  # as Hydra reports it (HYDRA_FULL_ERROR as the user set it)
            raise
        fail(error)
    finally:
        _restore_full_error()


if __name__ == "__main__":
    # Run the importable module, not this `__main__` copy: the callback Hydra instantiates from
    # `gpuopt.run.ValidateBeforeRun` must share `_user_full_error` with `cli()`.
    from gpuopt.run import cli as run_cli

    run_cli()
