"""`python -m gpuopt.run [overrides]`: measure one training configuration (or, with -m, a sweep).

One route per trial: the composed config -> the allocator environment (torch reads it when it is
imported) -> `prepare_trial`: `load_spec` (the values checked, the targets imported: the one
TrialSpec) and `trial_device` (the device checked and resolved, once) ->
`gpuopt.engines.registry.run_trial(spec, device)` -> the one `TrialResult`: a table, and
result.json in the run directory. It is returned for the sweeper. torch is imported only inside
functions: the sweeper process imports this module too and must stay light.

Bad input ends the command with one line on stderr and exit status 2, before anything is created:
`cli()` parses the arguments itself (argparse's usage block would be many lines), turns Hydra's
composition errors into `ConfigError`s (Hydra raises them to us under HYDRA_FULL_ERROR, which
`cli()` sets only until the job starts), and the `ValidateBeforeRun` callback (conf/config.yaml,
`hydra.callbacks`) prepares the trial in `on_run_start`, which Hydra calls before it creates the
run directory. The task then measures what the callback prepared; a trial of a sweep (and
`run_config` called directly) prepares its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from gpuopt.core._compat import hydra_args_parser, report_as_hydra
from gpuopt.core.checks import Checked, check_values, check_writable_path
from gpuopt.core.errors import ConfigError, ConfigFileError, config_error_from_omegaconf
from gpuopt.core.fmt import fixed, limit_share
from gpuopt.core.host import usable_cpus
from gpuopt.core.result import Status, TrialResult
from gpuopt.core.secrets import mask_secrets
from gpuopt.core.spec import register_schemas
from gpuopt.engines.registry import load_spec, run_trial

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from gpuopt.core.spec import TrialSpec

log = logging.getLogger(__name__)
RESULT_FILE = "result.json"

# Before @hydra.main composes: the defaults list starts with the schema `gpuopt_schema`.
register_schemas()


def _hydra_context() -> tuple[bool, Path | None]:
    """(multirun?, run output dir) from Hydra, or (False, None) outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False, None
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    return hydra_cfg.mode == RunMode.MULTIRUN, Path(output_dir) if output_dir else None


def _resolved_config(cfg: DictConfig) -> dict[str, Any]:
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an unresolvable interpolation: keep it as written
        container = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(container, dict)
    return container


@dataclass(frozen=True)
class PreparedTrial:
    """A composed config validated and on its device: what the route hands the engine."""

    composed: dict[str, Any]  # the config as written (no `hydra` node): which config this is
    spec: TrialSpec
    device: torch.device
    warnings: list[str]  # the allocator's and the device's


def _as_written(cfg: DictConfig) -> dict[str, Any]:
    """The trial's settings as composed, unresolved, without Hydra's own node (the callback sees
    it, the task does not)."""
    container = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(container, dict)
    return {key: value for key, value in container.items() if key != "hydra"}


def apply_allocator_settings(cfg: DictConfig) -> list[str]:
    """`cache.cuda_alloc_conf` and `cache.cpu_thp` into the environment, which torch reads when it
    is imported: before `load_spec`, which imports the model's module, hence torch."""
    from gpuopt.trial.knobs import apply_allocator_env

    return apply_allocator_env(cfg.cache.cuda_alloc_conf, bool(cfg.cache.cpu_thp))


def prepare_trial(
    cfg: DictConfig, warnings: list[str], checked: Checked | None = None
) -> PreparedTrial:
    """The trial's one validation (`load_spec`: the values unless already `checked`, then the
    targets) and its device, resolved once (`trial_device`); `warnings` (the allocator's) travel
    with them. Raises ConfigError. The allocator settings must already be applied
    (`apply_allocator_settings`)."""
    from gpuopt.trial.devices import trial_device

    spec = load_spec(cfg, checked)
    device, device_warnings = trial_device(spec)
    return PreparedTrial(_as_written(cfg), spec, device, [*warnings, *device_warnings])


# What the callback prepared for the task it runs before (a single run: the same process).
_prepared: PreparedTrial | None = None


def _take_prepared(cfg: DictConfig) -> PreparedTrial | None:
    """The callback's prepared trial if it is this config's (once), else None."""
    global _prepared
    prepared, _prepared = _prepared, None
    return prepared if prepared is not None and prepared.composed == _as_written(cfg) else None


def run_config(
    cfg: DictConfig, output_dir: Path | None = None, multirun: bool = False
) -> TrialResult:
    """Measure one composed config; save result.json into `output_dir` if given.

    A ConfigError exits the process with a one-line message (single run), or becomes an `error`
    result (multirun: one bad trial must not end a sweep).
    """
    prepared = _take_prepared(cfg)
    if prepared is None:
        warnings = apply_allocator_settings(cfg)
        try:
            prepared = prepare_trial(cfg, warnings)
        except ConfigError as exc:
            if not multirun:
                fail(exc)
            return _error_result(exc, cfg, warnings, output_dir)

    result = run_trial(prepared.spec, device=prepared.device)
    result.warnings = prepared.warnings + result.warnings
    result.config = _resolved_config(cfg)
    if output_dir is not None:
        result.save(output_dir / RESULT_FILE)
    if not multirun:
        print_result(result, output_dir / RESULT_FILE if output_dir is not None else None)
    return result


def _error_result(
    exc: ConfigError, cfg: DictConfig, warnings: list[str], output_dir: Path | None
) -> TrialResult:
    """A sweep's trial with a bad config: an `error` result (saved like any other)."""
    result = TrialResult(
        status=Status.ERROR, reason=str(exc), config=_resolved_config(cfg), warnings=warnings
    )
    if output_dir is not None:
        result.save(output_dir / RESULT_FILE)
    return result


# The one target Hydra itself instantiates from gpuopt's config (`hydra.callbacks`); gpuopt's own
# instantiate() calls pass their own whitelists (the `trust` list, the sampler whitelist).
HYDRA_EXECUTION_WHITELIST = ("gpuopt.run.ValidateBeforeRun",)


@hydra.main(
    config_path="pkg://gpuopt.conf",
    config_name="config",
    execution_whitelist=HYDRA_EXECUTION_WHITELIST,
)
def main(cfg: DictConfig) -> TrialResult:
    multirun, output_dir = _hydra_context()
    return run_config(cfg, output_dir, multirun)


def print_result(
    result: TrialResult, saved_to: Path | None = None, console: Console | None = None
) -> None:
    """A readable table of one trial's result (rich), then its reason and warnings (the
    hypervisor's steal among them) below it, where a long line is not cut to a column."""
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


Row = tuple[str, str, str]


def _result_rows(result: TrialResult) -> list[Row]:
    """The table's rows, in reading order. What not every trial measures (a user step has no
    limit, a host without /proc/stat no steal) has a row only where it was measured; the limit's
    words are the sweep summary's and the report's (gpuopt.core.fmt.limit_share)."""
    m = result.metrics
    ci = f"± {m.throughput_ci * 100:.1f}% (95% CI)" if m.throughput_ci is not None else ""
    epoch = (
        f"over {fixed(m.epoch_steps)}-step epochs (boundary {fixed(m.epoch_overhead_s, ' s', 2)})"
    )
    share = limit_share(dataclasses.asdict(m))
    rows = [
        ("throughput", fixed(m.throughput, " samples/s", 1), ci),
        *_if_measured(m.throughput_amortized,
                      ("throughput (amortized)", fixed(m.throughput_amortized, " samples/s", 1), epoch)),
        ("step time (median)", fixed(m.step_time_ms, " ms", 3),
         (f"p10 {fixed(m.step_time_p10_ms, ' ms', 3)}, p90 {fixed(m.step_time_p90_ms, ' ms', 3)}, "
          f"cv {fixed(m.step_time_cv, '', 3)}")),
        ("data wait", fixed(m.data_wait, " %", 1), "CUDA: GPU idle for input; CPU: host wait"),
        ("host data wait", fixed(m.host_data_wait, " %", 1), "host time in next(loader)"),
        ("utilization", fixed(m.utilization, " %", 1), "NVML on NVIDIA; CPU: 100 - data wait"),
        ("compute ceiling", fixed(m.ceiling_throughput, " samples/s", 1), "one on-device batch, no loader"),
        ("input efficiency", fixed(m.input_efficiency, " %", 1), "throughput / ceiling"),
        *_if_measured(share, ("machine limit", fixed(m.limit_throughput, " samples/s", 1), f"at {share}")),
        ("MFU", fixed(m.mfu, " %", 2), "of the device's dense peak for the dtype"),
        *_if_measured(m.mfu_achievable,
                      ("MFU (achievable)", fixed(m.mfu_achievable, " %", 2), "of the measured matmul peak")),
        ("FLOPs / sample", fixed(m.flops_per_sample, "", 0), "forward + backward"),
        ("peak memory", fixed(m.peak_memory_mb, " MB", 1), ""),
        ("power", fixed(m.power_w, " W", 1), ""),
        ("energy / sample", fixed(m.energy_per_sample_j, " J", 4), ""),
        ("compile time", fixed(m.compile_time_s, " s", 2), "first step through torch.compile"),
        ("warm-up time", fixed(m.warmup_time_s, " s", 2), ""),
        ("startup time", fixed(m.startup_time_s, " s", 2), "process start -> first timed step"),
        ("timed window", f"{fixed(m.timed_steps)} steps in {fixed(m.timed_seconds, ' s', 2)}",
         f"stopped: {m.stop_reason or '-'}"),
        *_if_measured(m.cpu_steal_pct,
                      ("CPU steal", fixed(m.cpu_steal_pct, " %", 1), "CPU time the hypervisor gave other guests")),
        ("device", str(result.env.get("device_name", "-")), str(result.env.get("device", ""))),
    ]  # fmt: skip
    if m.world_size:  # a distributed trial: one result for the whole job
        rows.append(_ranks_row(result))
    if m.comm_share is not None:  # its profiled window (profile=on): the ranks' mean
        note = (
            f"exposed {fixed(m.comm_exposed, ' %', 1)}, overlapped "
            f"{fixed(m.comm_overlapped, ' %', 1)} of the profiled step (mean over ranks)"
        )
        rows.append(("communication", fixed(m.comm_share, " %", 1), note))
    return rows


def _if_measured(value: object, row: Row) -> list[Row]:
    """`row` where its metric was measured; none, rather than a "-", where it was not."""
    return [row] if value is not None else []


def _ranks_row(result: TrialResult) -> tuple[str, str, str]:
    """A distributed trial's ranks: how many, the straggler, how far step times and peaks spread."""
    m = result.metrics
    note = (
        f"straggler rank {fixed(m.straggler_rank)}, step time spread "
        f"{fixed(m.step_time_spread, ' %', 1)}, peak memory spread "
        f"{fixed(m.peak_memory_spread_mb, ' MB', 1)}"
    )
    return ("ranks", f"{m.world_size} ({result.env.get('backend', '-')})", note)


# --- bad input: one line on stderr, exit status 2, nothing created --------------------------------

BAD_INPUT_EXIT = 2
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"
_user_full_error: str | None = None  # the user's own HYDRA_FULL_ERROR, restored once a job starts


def fail(error: ConfigError | str) -> None:
    """The one line for bad input, then exit status 2; secrets masked (an unquoted storage URL
    with `?password=...` fails Hydra's override grammar, whose error line quotes it)."""
    line = mask_secrets(" ".join(str(error).split()))
    print(f"gpuopt: {line}", file=sys.stderr)
    sys.exit(BAD_INPUT_EXIT)


def _restore_full_error() -> None:
    """Hand Hydra's error reporting back to it (and to trial processes) as the user set it."""
    if _user_full_error is None:
        os.environ.pop(FULL_ERROR_ENV, None)
    else:
        os.environ[FULL_ERROR_ENV] = _user_full_error


def check_before_run(config: DictConfig) -> None:
    """Everything a single run can get wrong, before Hydra creates its run directory: the values
    (torch-free, so the common mistakes fail fast), where the run writes, then the trial prepared
    (the targets import, the device is here and runs the settings), for the task to measure."""
    global _prepared
    checked = check_values(config, usable_cpus())
    check_writable_path("hydra.run.dir", str(config.hydra.run.dir), directory=True)
    _prepared = prepare_trial(config, apply_allocator_settings(config), checked)


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


def _parsed_overrides(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # the parse error itself is reported from Hydra's own exception
        return []


def _override_error(message: str, overrides: list[str], multirun: bool) -> ConfigError | None:
    """A composition error without an OmegaConf cause, pinned to the override it names."""
    for override in _parsed_overrides(overrides):
        key = override.key_or_group
        if f"'{key}" not in message:
            continue
        value = override.value() if not override.is_delete() else None
        if override.is_sweep_override() and not multirun:
            return ConfigError(
                key,
                override.input_line.split("=", 1)[-1],
                "one value in a single run (sweep with "
                "-m; a list is [a,b]; a string with commas is quoted)",
            )
        if override.is_add():
            return ConfigError(
                key, value, f"{key}=... without '+' (the key exists), or ++{key}=... to force it"
            )
        if override.is_delete():
            return ConfigError(key, "~", "deleting only a key or group the config has")
        return ConfigError(key, value, " ".join(message.split()))
    return None


def config_error_from_hydra(
    exc: BaseException, overrides: list[str], multirun: bool = False
) -> ConfigError | None:
    """Hydra's composition errors as one `ConfigError`, from their attributes; None for others."""
    import yaml
    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
        SearchPathException,
    )
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return ConfigFileError(mark.name, mark.line + 1, mark.column + 1, str(exc.problem))
    if isinstance(exc, MissingConfigException):
        missing = exc.missing_cfg_file or "?"
        if exc.options is None:  # the primary config
            return ConfigError("--config-name", missing, "a config in the config search path")
        group, _, option = missing.rpartition("/")
        allowed = " | ".join(exc.options) or "no options found"
        return ConfigError(group, option, f"{allowed} (no {missing}.yaml in the search path)")
    if isinstance(exc, OverrideParseException):
        key, _, value = exc.override.partition("=")
        lines = exc.message.splitlines()  # the parser's reason is the second line
        reason = lines[1] if len(lines) > 1 else lines[0]
        return ConfigError(
            key,
            value,
            f"Hydra's override grammar ({' '.join(reason.split())}; see "
            "https://hydra.cc/docs/advanced/override_grammar/basic)",
        )
    if isinstance(exc, SearchPathException):
        return ConfigError(
            "--config-dir",
            str(exc).split("'")[1] if "'" in str(exc) else "?",
            "an existing directory",
        )
    if isinstance(exc.__cause__, OmegaConfBaseException):
        error = config_error_from_omegaconf(exc.__cause__)
        values = {o.key_or_group: o.value() for o in _parsed_overrides(overrides)}
        return ConfigError(error.key, values.get(error.key, error.value), error.allowed)
    if isinstance(exc, OmegaConfBaseException):
        return config_error_from_omegaconf(exc)
    if isinstance(exc, ConfigCompositionException):
        return _override_error(str(exc), overrides, multirun) or ConfigError(
            "overrides", " ".join(overrides), " ".join(str(exc).split())
        )
    return None


def _check_arguments(argv: list[str]) -> Any:
    """Hydra's own argument parser, failing with one line instead of its usage block."""
    parser = hydra_args_parser()

    def one_line_error(message: str) -> None:
        fail(f"invalid argument: {message}; allowed: see python -m gpuopt.run --help")

    parser.error = one_line_error  # type: ignore[method-assign]
    return parser.parse_intermixed_args(argv)


def cli() -> None:
    """`python -m gpuopt.run`: Hydra's main, with bad input reported as one line and exit 2."""
    global _user_full_error
    args = _check_arguments(sys.argv[1:])
    _user_full_error = os.environ.get(FULL_ERROR_ENV)
    os.environ[FULL_ERROR_ENV] = "1"  # until the job starts, Hydra raises its errors to us
    try:
        main()
    except Exception as exc:
        _restore_full_error()
        error = (
            None
            if _user_full_error
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
