"""`python -m gpuopt.run [overrides]`: measure one training configuration (or, with -m, a sweep).

The task function is thin: allocator environment (before torch is imported), validation, device
checks, `run_trial`, a result table, result.json in the run directory. It returns the `TrialResult`
for the sweeper. torch is imported only inside functions: the sweeper process imports this module
too and must stay light.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from gpuopt.config import ConfigError, register_schemas, validate
from gpuopt.result import Status, TrialResult

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


def run_config(
    cfg: DictConfig, output_dir: Path | None = None, multirun: bool = False
) -> TrialResult:
    """Validate and measure one composed config; save result.json into `output_dir` if given.

    A ConfigError exits the process with a one-line message (single run), or becomes an `error`
    result (multirun: one bad trial must not end a sweep).
    """
    from gpuopt.policies import apply_allocator_env

    # Allocator settings are read when torch is imported, so before validate() (which imports the
    # model's module, hence torch).
    warnings = apply_allocator_env(cfg.cache.cuda_alloc_conf, bool(cfg.cache.cpu_thp))
    try:
        spec = validate(cfg)
        from gpuopt.env import check_device_support

        device, device_warnings = check_device_support(spec)
    except ConfigError as exc:
        if not multirun:
            print(f"gpuopt: {exc}", file=sys.stderr)
            sys.exit(2)
        result = TrialResult(
            status=Status.ERROR, reason=str(exc), config=_resolved_config(cfg), warnings=warnings
        )
        if output_dir is not None:
            result.save(output_dir / RESULT_FILE)
        return result

    from gpuopt.engines import run_trial

    result = run_trial(spec, device=device)
    result.warnings = warnings + device_warnings + result.warnings
    result.config = _resolved_config(cfg)
    if output_dir is not None:
        result.save(output_dir / RESULT_FILE)
    if not multirun:
        print_result(result, output_dir / RESULT_FILE if output_dir is not None else None)
    return result


@hydra.main(config_path="pkg://gpuopt.conf", config_name="config")
def main(cfg: DictConfig) -> TrialResult:
    multirun, output_dir = _hydra_context()
    return run_config(cfg, output_dir, multirun)


def _fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value}{unit}"


def print_result(result: TrialResult, saved_to: Path | None = None) -> None:
    """A readable table of one trial's result (rich)."""
    from rich.console import Console
    from rich.table import Table

    m = result.metrics
    colour = {"ok": "green", "oom": "yellow", "diverged": "yellow"}.get(result.status.value, "red")
    table = Table(
        title=f"gpuopt trial: [{colour}]{result.status.value}[/{colour}]", show_header=False
    )
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_column("note")
    ci = f"± {m.throughput_ci * 100:.1f}% (95% CI)" if m.throughput_ci is not None else ""
    rows = [
        ("throughput", _fmt(m.throughput, " samples/s", 1), ci),
        ("step time (median)", _fmt(m.step_time_ms, " ms", 3),
         (f"p10 {_fmt(m.step_time_p10_ms, ' ms', 3)}, p90 {_fmt(m.step_time_p90_ms, ' ms', 3)}, "
          f"cv {_fmt(m.step_time_cv, '', 3)}")),
        ("data wait", _fmt(m.data_wait, " %", 1), "time blocked on the next batch"),
        ("utilization", _fmt(m.utilization, " %", 1), "NVML on NVIDIA; CPU: 100 - data wait"),
        ("compute ceiling", _fmt(m.ceiling_throughput, " samples/s", 1), "one on-device batch, no loader"),
        ("input efficiency", _fmt(m.input_efficiency, " %", 1), "throughput / ceiling"),
        ("MFU", _fmt(m.mfu, " %", 2), "of the device's dense peak for the dtype"),
        ("FLOPs / sample", _fmt(m.flops_per_sample, "", 0), "forward + backward"),
        ("peak memory", _fmt(m.peak_memory_mb, " MB", 1), ""),
        ("power", _fmt(m.power_w, " W", 1), ""),
        ("energy / sample", _fmt(m.energy_per_sample_j, " J", 4), ""),
        ("compile time", _fmt(m.compile_time_s, " s", 2), "first step through torch.compile"),
        ("warm-up time", _fmt(m.warmup_time_s, " s", 2), ""),
        ("startup time", _fmt(m.startup_time_s, " s", 2), "process start -> first timed step"),
        ("timed window", f"{_fmt(m.timed_steps)} steps in {_fmt(m.timed_seconds, ' s', 2)}",
         f"stopped: {m.stop_reason or '-'}"),
        ("device", str(result.env.get("device_name", "-")), str(result.env.get("device", ""))),
    ]  # fmt: skip
    for row in rows:
        table.add_row(*row)
    console = Console()
    console.print(table)
    if result.reason:
        console.print(f"[{colour}]reason:[/{colour}] {result.reason}")
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    if saved_to is not None:
        console.print(f"result: {saved_to}")


if __name__ == "__main__":
    main()
