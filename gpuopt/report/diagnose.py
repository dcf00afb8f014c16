"""Bottleneck diagnosis: what limits a trial's throughput, with the numbers that say so.

The rules read only measured metrics (see gpuopt/core/result.py, `Metrics`) and never guess past them:

0. at the machine's limit_efficiency >= LIMIT_HIGH_PCT: throughput is close to the most these cores
   limit             and this device can do for the workload (gpuopt.core.limits): no setting helps much,
                     only cheaper data, more cores, or (when the compute bounds it) less math
1. input-bound       data_wait >= DATA_WAIT_HIGH_PCT or input_efficiency <= INPUT_EFFICIENCY_LOW_PCT
                     (the device waits for the next batch / the loader costs throughput vs. the
                     compute-only ceiling). data_wait is the device's starvation: on CUDA read on
                     the GPU timeline, never host_data_wait (loader time that overlaps queued
                     compute costs nothing); elsewhere the host's wait, the same thing there
2. host/launch-bound (GPU) utilization < UTILIZATION_LOW_PCT without data wait: the GPU idles
                     between kernels because the CPU cannot issue them fast enough
3. memory-bound or   (GPU) utilization high but mfu < MFU_LOW_PCT: kernels run, but do little math
   small kernels     (bandwidth-bound elementwise ops, or kernels too small to fill the device)
4. near the limit    mfu >= MFU_HIGH_PCT: little left to gain from the same math
5. compute-bound     busy, mfu between the two thresholds - or on CPU, where utilization is derived
                     as 100 - data_wait and MFU is not measured ("MFU unknown")

Where the GPU has GPM (Hopper and newer), two rules read what utilization cannot
(gpuopt/report/gpm_rules.py): busy but idle SMs (utilization high, sm_active low: kernels too
small or launch-bound), before the utilization rule; tensor cores idle in a matmul-heavy step at
fp32, before the MFU rules.

The rules are the table `RULES` (first match wins), each a small `Rule`: when it applies, its
verdict, the evidence lines it cites and its suggestions. What they read (`Facts`), the thresholds
above and the helpers that cite evidence and suggest settings are gpuopt/report/evidence.py.
Utilization only counts as evidence on CUDA devices, where it is NVML's sampled
`utilization.gpu`; elsewhere it is derived from data_wait and says nothing new.

A profiled trial (gpuopt.trial.profiled_window; the user attribute `profile`) adds its phase breakdown: every
verdict then cites the shares of the step ("53% of the step in next(loader)"), the evidence lists
all phases, and phase-specific tips come first ("optimizer 18% of the step: try
optimizer.fused=true"). On CUDA its GPU time split adds a rule of its own, before NVML's: GPU idle
with most of it host wait (the next kernel not launched yet) is launch-bound.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gpuopt.core.knobs import MICRO_BATCH, THREADS
from gpuopt.core.limits import HighestLimit
from gpuopt.report.evidence import (
    MFU_HIGH_PCT,
    MFU_LOW_PCT,
    UTILIZATION_LOW_PCT,
    Facts,
    at_limit,
    cpu_compute_summary,
    cpu_evidence,
    gpu_evidence,
    host_suggestions,
    idle_citation,
    input_bound,
    input_citation,
    input_evidence,
    input_suggestions,
    largest_phase_citation,
    launch_bound_profiled,
    limit_evidence,
    limit_suggestions,
    limit_summary,
    memory_suggestions,
    merge_tips,
    no_input_evidence,
    nothing,
    phase_evidence,
    phase_suggestions,
)
from gpuopt.report.gpm_rules import (
    busy_but_idle_sms,
    idle_sms_evidence,
    idle_sms_suggestions,
    idle_sms_summary,
    idle_tensor_cores,
    idle_tensor_evidence,
    idle_tensor_suggestions,
    idle_tensor_summary,
)

NEAR_LIMIT_SUMMARY = (
    "MFU is close to what dense training reaches: little to gain from the same math"
)


class Bottleneck(str, Enum):
    INPUT = "input-bound"
    HOST = "host/launch-bound"
    MEMORY_OR_SMALL_KERNELS = "memory-bound or small kernels"
    NEAR_LIMIT = "near the compute limit"
    AT_MACHINE_LIMIT = "at the machine's limit"
    COMPUTE = "compute-bound"
    UNKNOWN = "unknown"  # the metrics needed for a verdict were not recorded
    NOT_MEASURED = "not measured"  # the trial did not finish a timed window (oom, diverged, error)


@dataclass
class Diagnosis:
    bottleneck: Bottleneck
    summary: str  # one sentence
    evidence: list[str] = field(default_factory=list)  # the numbers behind the verdict
    suggestions: list[str] = field(default_factory=list)  # what to try next, as config keys


@dataclass(frozen=True)
class Rule:
    """One bottleneck rule: when it applies, its verdict, the evidence lines it cites and what
    it suggests. `RULES` is read in order; the first rule that applies gives the diagnosis.
    When the trial was profiled, `cite` adds the phase shares behind the verdict to its summary,
    and every measured verdict lists the phases and puts the phase tips first."""

    name: str
    applies: Callable[[Facts], bool]
    bottleneck: Bottleneck
    summary: str | Callable[[Facts], str]
    evidence: Callable[[Facts], list[str]] = nothing
    suggestions: Callable[[Facts], list[str]] = nothing
    cite: Callable[[Facts], str | None] = largest_phase_citation

    def diagnose(self, f: Facts) -> Diagnosis:
        summary = self.summary if isinstance(self.summary, str) else self.summary(f)
        if f.status != "ok":
            return Diagnosis(self.bottleneck, summary, self.evidence(f), self.suggestions(f))
        citation = self.cite(f)
        if citation:
            summary = f"{summary} ({citation})"
        return Diagnosis(
            self.bottleneck,
            summary,
            [*self.evidence(f), *phase_evidence(f)],
            merge_tips(phase_suggestions(f), self.suggestions(f)),
        )


RULES: tuple[Rule, ...] = (
    Rule(
        "not measured",
        lambda f: f.status != "ok",
        Bottleneck.NOT_MEASURED,
        lambda f: f"no timed window: the trial ended as {f.status}",
    ),
    Rule(
        "at the machine's limit",
        at_limit,
        Bottleneck.AT_MACHINE_LIMIT,
        limit_summary,
        limit_evidence,
        limit_suggestions,
    ),
    Rule(
        "no input metrics",
        lambda f: f.data_wait is None and f.input_efficiency is None,
        Bottleneck.UNKNOWN,
        "cannot tell whether the input pipeline limits throughput",
        no_input_evidence,
    ),
    Rule(
        "input-bound",
        input_bound,
        Bottleneck.INPUT,
        "the step waits for data: the input pipeline limits throughput",
        input_evidence,
        lambda f: input_suggestions(f.config, f.cuda),
        input_citation,
    ),
    Rule(
        "CPU near the limit",
        lambda f: not f.cuda and f.mfu is not None and f.mfu >= MFU_HIGH_PCT,
        Bottleneck.NEAR_LIMIT,
        NEAR_LIMIT_SUMMARY,
        cpu_evidence,
        lambda f: ["less work per sample (smaller model, fewer FLOPs) is what is left"],
    ),
    Rule(
        "CPU compute-bound",
        lambda f: not f.cuda,
        Bottleneck.COMPUTE,
        cpu_compute_summary,
        cpu_evidence,
        lambda f: [f"compute threads: {THREADS.key}", f"larger batch: {MICRO_BATCH.key}"],
    ),
    Rule(
        "launch-bound (profiled)",
        launch_bound_profiled,
        Bottleneck.HOST,
        "the GPU waits for the host to launch work: host/launch overhead limits throughput",
        gpu_evidence,
        host_suggestions,
        idle_citation,
    ),
    Rule(
        "busy GPU, idle SMs (GPM)",
        busy_but_idle_sms,
        Bottleneck.HOST,
        idle_sms_summary,
        idle_sms_evidence,
        idle_sms_suggestions,
    ),
    Rule(
        "host/launch-bound",
        lambda f: f.cuda and f.utilization is not None and f.utilization < UTILIZATION_LOW_PCT,
        Bottleneck.HOST,
        "the GPU idles between kernels without waiting for data: "
        "host/launch overhead limits throughput",
        gpu_evidence,
        host_suggestions,
        lambda f: idle_citation(f) or largest_phase_citation(f),
    ),
    Rule(
        "tensor cores idle at fp32 (GPM)",
        idle_tensor_cores,
        Bottleneck.COMPUTE,
        idle_tensor_summary,
        idle_tensor_evidence,
        idle_tensor_suggestions,
    ),
    Rule(
        "busy GPU, MFU unknown",
        lambda f: f.cuda and f.mfu is None,
        Bottleneck.COMPUTE,
        "the GPU is busy; MFU unknown, so memory-bound and near-the-limit cannot be told apart",
        gpu_evidence,
    ),
    Rule(
        "GPU near the limit",
        lambda f: f.cuda and f.mfu is not None and f.mfu >= MFU_HIGH_PCT,
        Bottleneck.NEAR_LIMIT,
        NEAR_LIMIT_SUMMARY,
        gpu_evidence,
        lambda f: [
            "less work per sample is what is left (lower precision if not yet, smaller model)"
        ],
    ),
    Rule(
        "low MFU, utilization unknown",
        lambda f: f.cuda and f.mfu is not None and f.mfu < MFU_LOW_PCT and f.utilization is None,
        Bottleneck.UNKNOWN,
        "low MFU, but without utilization host-bound and memory-bound cannot be told apart",
        gpu_evidence,
    ),
    Rule(
        "memory-bound or small kernels",
        lambda f: f.cuda and f.mfu is not None and f.mfu < MFU_LOW_PCT,
        Bottleneck.MEMORY_OR_SMALL_KERNELS,
        "the GPU is busy but does little math: memory-bound or small kernels",
        gpu_evidence,
        memory_suggestions,
    ),
    Rule(
        "GPU compute-bound",
        lambda f: f.cuda,
        Bottleneck.COMPUTE,
        "the GPU is busy with useful math; no single cause stands out",
        gpu_evidence,
        lambda f: [f"{MICRO_BATCH.tip} or lower precision may still help"],
    ),
)


def diagnose(
    metrics: Mapping[str, Any],
    *,
    status: str = "ok",
    device_type: str | None = None,
    config: Mapping[str, Any] | None = None,
    highest: HighestLimit | None = None,
) -> Diagnosis:
    """Diagnose one trial from its metrics (flat user attributes), status and device type: the
    first rule of `RULES` that applies.

    `device_type` is "cuda", "cuda:N", "cpu", "mps" or None (unknown); `config` (the resolved trial
    config) only tailors the suggestions; `highest` (the study's highest measured limit,
    gpuopt.core.limits.highest_limit) keeps a trial at its own settings' limit from reading as "only
    cheaper data or more cores help" when other settings measured more.
    """
    facts = Facts.of(metrics, status, device_type, config or {}, highest)
    rule = next(rule for rule in RULES if rule.applies(facts))
    return rule.diagnose(facts)
