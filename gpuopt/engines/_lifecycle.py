"""The lifecycle every engine shares: one trial from its measuring to its one `TrialResult`.

`run_measured` is the route of a trial: the engine's `measure(trial, process_t0)` fills the trial's
context, a failure becomes the status, what the engine built is released, then the steps the
engine asked for once its memory is free run (the numerics guard), and the result is built once.
torch is imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuopt.core.host import proc_stat
from gpuopt.core.result import Status, TrialResult
from gpuopt.core.spec import TrialSpec
from gpuopt.trial.context import Trial
from gpuopt.trial.failures import classify_failure

if TYPE_CHECKING:
    import torch

    from gpuopt.core.spec import EngineConf, LoaderConf, MeasureConf


# An engine: fills `trial.metrics`, raising on failure; `process_t0`: startup_time_s's origin.
Measure = Callable[[Trial, float], None]


# Trials run so far in this process: startup_time_s counts from process start only for the first.
_trials_in_process = 0
_MODULE_LOADED_AT = time.time()  # the fallback "earliest timestamp" when /proc is absent


def process_start_time() -> float | None:
    """When this process started (time.time() epoch), from /proc on Linux; None elsewhere. From
    the process's age (uptime - starttime, 10 ms resolution): /proc/stat's btime has 1 s only."""
    fields = proc_stat("self")
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def measuring_spec(
    device: torch.device,
    measure: MeasureConf,
    engine: EngineConf,
    precision_mode: str = "fp32",
    compile_mode: str = "off",
    loader: LoaderConf | None = None,
) -> TrialSpec:
    """A TrialSpec for measuring what the user built (gpuopt.measure_step, the callbacks): the
    measure settings and what the clocks need to know; the rest default (gpuopt builds nothing)."""
    from gpuopt.core import spec as schemas

    return TrialSpec(
        model={},
        data={},
        loader=loader or schemas.LoaderConf(),
        precision=schemas.PrecisionConf(mode=precision_mode),
        compile=schemas.CompileConf(mode=compile_mode),
        cache=schemas.CacheConf(),
        optimizer=schemas.OptimizerConf(),
        device=schemas.DeviceConf(type=str(device)),
        measure=measure,
        loss="model",
        seed=0,
        trusted_targets=(),
        engine=engine,
    )


def spec_to_dict(spec: TrialSpec) -> dict[str, Any]:
    """The result's `config`: the spec as plain data (the sweeper stores and compares it)."""
    data = dataclasses.asdict(spec)
    data["trusted_targets"] = list(spec.trusted_targets)
    return data


# A window that lost more of the machine's CPU time than this to the hypervisor is flagged.
STEAL_WARN_PCT = 5.0


def run_measured(
    spec: TrialSpec,
    measure: Measure,
    device: torch.device | None = None,
    inspect: Callable[[str, Any], None] | None = None,
) -> TrialResult:
    """Measure one configuration with the engine's `measure` and return its one result. Never
    raises for a failing workload: OOM, divergence and errors come back as the status."""
    from gpuopt.trial.devices import fingerprint, resolve_device

    global _trials_in_process
    started = time.perf_counter()
    earlier_trial, _trials_in_process = _trials_in_process > 0, _trials_in_process + 1
    process_t0 = time.time() if earlier_trial else process_start_time() or _MODULE_LOADED_AT
    device = device if device is not None else resolve_device(spec.device.type)
    trial = Trial(spec, device, inspect=inspect)
    status, reason = Status.OK, None
    try:
        measure(trial, process_t0)
    except Exception as exc:
        status, reason = classify_failure(exc)
    finally:
        with trial.phase("release"):
            release(trial, status)
    trial.warnings += _process_notes(trial, earlier_trial)
    with trial.phase("fingerprint"):
        env = fingerprint(device)
    if status is Status.OK:
        for step in trial.after_release:  # outside the window, the trial's memory released
            step(trial)
    # `other`: the wall time no named phase covered (all of it for an engine that names none).
    trial.phases["other"] = max(0.0, time.perf_counter() - started - sum(trial.phases.values()))
    return TrialResult(
        status=status,
        metrics=trial.metrics,
        reason=reason,
        config=spec_to_dict(spec),
        env=env,
        warnings=trial.warnings,
        profile=trial.profile,
        numerics=trial.numerics,
        phases={name: round(seconds, 6) for name, seconds in trial.phases.items()},
    )


def _process_notes(trial: Trial, earlier_trial: bool) -> list[str]:
    """What the process does to this trial's numbers: an earlier trial in it, the hypervisor's steal."""
    notes = []
    if earlier_trial:
        notes.append(
            "startup_time_s counts from the start of this trial (not process start): "
            "an earlier trial ran in this process"
        )
    if (steal := trial.metrics.cpu_steal_pct) is not None and steal > STEAL_WARN_PCT:
        notes.append(
            f"the hypervisor gave {steal:.0f}% of this machine's CPU time to other guests during "
            "the timed window (cpu_steal_pct): this trial's numbers read low by up to that much"
        )
    return notes


def release(trial: Trial, status: Status) -> None:
    """Let go of what the trial built and give the allocator's cache back as the cache policy
    says (always after an OOM). In-process clean-up between trials belongs here."""
    from gpuopt.trial.policies import CachePolicy, empty_device_cache

    for resource in trial.resources:
        close = getattr(resource, "close", None)
        if callable(close):
            close()
    trial.resources.clear()
    if trial.spec.compile.mode != "off":
        # The next in-process trial compiles afresh (no cache hit, no recompile-limit carry-over);
        # on CUDA this also releases the CUDA-graph trees' private memory pools to the allocator.
        import torch

        torch.compiler.reset()
    gc.collect()
    CachePolicy(trial.spec.cache, trial.device).at_trial_end()
    if status is Status.OOM:
        # After an OOM the cache holds the failed trial's blocks: always give them back, so the
        # next trial in this process starts from an empty device.
        empty_device_cache(trial.device)
