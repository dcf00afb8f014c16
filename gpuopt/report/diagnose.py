"""Bottleneck diagnosis: what limits a trial's throughput, with the numbers that say so.

The rules are the table `RULES` (first match wins; docs/report.md lists them), read only from
measured metrics, never guessing past one not recorded. What they read (`Facts`), their thresholds
and the helpers that cite evidence and suggest settings are gpuopt/report/evidence.py; the two that
read GPM (Hopper and newer) are below. data_wait is the device's starvation:
on CUDA read on the GPU timeline, never host_data_wait (loader time that overlaps queued compute
costs nothing). A profiled trial's verdicts cite its phase shares and put its phase tips first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gpuopt.core import knobs
from gpuopt.core.knobs import MICRO_BATCH, THREADS
from gpuopt.core.limits import HighestLimit
from gpuopt.report import evidence as ev
from gpuopt.report.evidence import Facts

NEAR_LIMIT_SUMMARY = (
    "MFU is close to what dense training reaches: little to gain from the same math"
)
# GPM (NVML GPU Performance Monitoring) tells apart what `utilization` (NVML's `utilization.gpu`:
# a kernel was running) cannot. SM activity (% of SMs busy over the window) below this on a GPU
# that reads busy: small or launch-bound kernels; large kernels keep most SMs busy while they run.
SM_ACTIVE_LOW_PCT = 50.0
# Tensor-pipe activity (GPM) below this: the tensor cores sit idle.
TENSOR_ACTIVE_LOW_PCT = 5.0
# A step whose counted matmul/convolution FLOPs reach this share of the fp32 peak (its mfu at
# fp32) spends much of its time in matmuls: the work tensor cores do.
MATMUL_HEAVY_MFU_PCT = 10.0


def _gpm_evidence(f: Facts, prefix: str, note: str) -> list[str]:
    """GPM's lines, the one starting with `prefix` read against its threshold (`note`)."""
    return [f"{line}; {note}" if line.startswith(prefix) else line for line in ev.gpm_lines(f)]


def _idle_sms_suggestions(f: Facts) -> list[str]:
    tips = [f"more work per kernel: {knobs.MICRO_BATCH.tip}"]
    if ev.uncompiled(f, "default"):
        tips.append(f"fewer launches: {knobs.COMPILE.tip} (torch.compile with CUDA graphs)")
    if f.setting(knobs.FUSED.key) is not True:
        tips.append(f"one kernel for the optimizer step: {knobs.FUSED.tip}")
    if f.setting("model.input") == "images" and f.setting(knobs.CHANNELS_LAST.key) is not True:
        tips.append(f"NHWC convolutions (fewer layout kernels): {knobs.CHANNELS_LAST.tip}")
    return tips


def _fp32(f: Facts) -> bool:
    if f.compute_dtype is not None:
        return f.compute_dtype == "fp32"
    return f.setting(knobs.PRECISION.key) in (None, "fp32")


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
    """One bottleneck rule: when it applies, its verdict, evidence and suggestions; `cite` adds
    the profiled phase shares behind the verdict to its summary."""

    applies: Callable[[Facts], bool]
    bottleneck: Bottleneck
    summary: str | Callable[[Facts], str]
    evidence: Callable[[Facts], list[str]] = lambda f: []
    suggestions: Callable[[Facts], list[str]] = lambda f: []
    cite: Callable[[Facts], str | None] = ev.largest_phase_citation

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
            [*self.evidence(f), *ev.phase_evidence(f)],
            ev.merge_tips(ev.phase_suggestions(f), self.suggestions(f)),
        )


RULES: tuple[Rule, ...] = (
    Rule(
        lambda f: f.status != "ok",
        Bottleneck.NOT_MEASURED,
        lambda f: f"no timed window: the trial ended as {f.status}",
    ),
    Rule(
        lambda f: f.limit_efficiency is not None and f.limit_efficiency >= ev.LIMIT_HIGH_PCT,
        Bottleneck.AT_MACHINE_LIMIT,
        ev.limit_summary,
        ev.limit_evidence,
        ev.limit_suggestions,
    ),
    Rule(
        lambda f: f.data_wait is None and f.input_efficiency is None,
        Bottleneck.UNKNOWN,
        "cannot tell whether the input pipeline limits throughput",
        lambda f: [*ev.input_evidence(f), "no data_wait or input_efficiency recorded"],
    ),
    Rule(
        lambda f: (
            (f.data_wait is not None and f.data_wait >= ev.DATA_WAIT_HIGH_PCT)
            or (
                f.input_efficiency is not None and f.input_efficiency <= ev.INPUT_EFFICIENCY_LOW_PCT
            )
        ),
        Bottleneck.INPUT,
        "the step waits for data: the input pipeline limits throughput",
        ev.input_evidence,
        ev.input_suggestions,
        ev.input_citation,
    ),
    Rule(
        lambda f: not f.cuda and f.mfu is not None and f.mfu >= ev.MFU_HIGH_PCT,
        Bottleneck.NEAR_LIMIT,
        NEAR_LIMIT_SUMMARY,
        ev.cpu_evidence,
        lambda f: ["less work per sample (smaller model, fewer FLOPs) is what is left"],
    ),
    Rule(
        lambda f: not f.cuda,
        Bottleneck.COMPUTE,
        ev.cpu_compute_summary,
        ev.cpu_evidence,
        lambda f: [f"compute threads: {THREADS.key}", f"larger batch: {MICRO_BATCH.key}"],
    ),
    Rule(
        lambda f: f.cuda and (f.gpu_share("host_wait") or 0.0) >= ev.HOST_WAIT_HIGH_PCT,
        Bottleneck.HOST,
        "the GPU waits for the host to launch work: host/launch overhead limits throughput",
        ev.gpu_evidence,
        ev.host_suggestions,
        ev.idle_citation,
    ),
    Rule(
        lambda f: (
            f.cuda
            and f.sm_active is not None
            and f.utilization is not None
            and f.utilization >= ev.UTILIZATION_LOW_PCT
            and f.sm_active < SM_ACTIVE_LOW_PCT
        ),
        Bottleneck.HOST,
        lambda f: (
            f"the GPU reads busy (util.gpu {f.utilization:.0f}%) but its SMs are active "
            f"{f.sm_active:.0f}%: kernels too small or launch-bound"
        ),
        lambda f: [
            *ev.input_evidence(f),
            f"GPU utilization {f.utilization:.1f}% (NVML util.gpu: a kernel was running; busy at "
            f">= {ev.UTILIZATION_LOW_PCT:g}%)",
            *_gpm_evidence(f, "SM activity", f"low below {SM_ACTIVE_LOW_PCT:g}%"),
            ev.mfu_text(f),
        ],
        _idle_sms_suggestions,
    ),
    Rule(
        lambda f: f.cuda and f.utilization is not None and f.utilization < ev.UTILIZATION_LOW_PCT,
        Bottleneck.HOST,
        "the GPU idles between kernels without waiting for data: "
        "host/launch overhead limits throughput",
        ev.gpu_evidence,
        ev.host_suggestions,
        lambda f: ev.idle_citation(f) or ev.largest_phase_citation(f),
    ),
    Rule(
        lambda f: (
            f.cuda
            and f.tensor_active is not None
            and f.tensor_active < TENSOR_ACTIVE_LOW_PCT
            and f.mfu is not None
            and f.mfu >= MATMUL_HEAVY_MFU_PCT
            and _fp32(f)
        ),
        Bottleneck.COMPUTE,
        lambda f: (
            f"the tensor cores sit idle (tensor-core activity {f.tensor_active:.1f}%) in a "
            f"matmul-heavy step at fp32 (mfu {f.mfu:.0f}% of the fp32 peak): bf16 or tf32 runs "
            "its matmuls on them"
        ),
        lambda f: [
            *ev.input_evidence(f),
            *_gpm_evidence(f, "tensor", f"idle below {TENSOR_ACTIVE_LOW_PCT:g}%"),
            f"compute dtype {f.compute_dtype or 'fp32'}",
            f"{ev.mfu_text(f)} (matmul-heavy at >= {MATMUL_HEAVY_MFU_PCT:g}% of the fp32 peak)",
        ],
        lambda f: [
            f"tensor cores: {knobs.PRECISION.tip}, or {knobs.PRECISION.group}=tf32 (fp32 "
            "storage, tf32 matmuls); the numerics guard checks either against fp32"
        ],
    ),
    Rule(
        lambda f: f.cuda and f.mfu is None,
        Bottleneck.COMPUTE,
        "the GPU is busy; MFU unknown, so memory-bound and near-the-limit cannot be told apart",
        ev.gpu_evidence,
    ),
    Rule(
        lambda f: f.cuda and f.mfu is not None and f.mfu >= ev.MFU_HIGH_PCT,
        Bottleneck.NEAR_LIMIT,
        NEAR_LIMIT_SUMMARY,
        ev.gpu_evidence,
        lambda f: [
            "less work per sample is what is left (lower precision if not yet, smaller model)"
        ],
    ),
    Rule(
        lambda f: f.cuda and f.mfu is not None and f.mfu < ev.MFU_LOW_PCT and f.utilization is None,
        Bottleneck.UNKNOWN,
        "low MFU, but without utilization host-bound and memory-bound cannot be told apart",
        ev.gpu_evidence,
    ),
    Rule(
        lambda f: f.cuda and f.mfu is not None and f.mfu < ev.MFU_LOW_PCT,
        Bottleneck.MEMORY_OR_SMALL_KERNELS,
        "the GPU is busy but does little math: memory-bound or small kernels",
        ev.gpu_evidence,
        ev.memory_suggestions,
    ),
    Rule(
        lambda f: f.cuda,
        Bottleneck.COMPUTE,
        "the GPU is busy with useful math; no single cause stands out",
        ev.gpu_evidence,
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
    """One trial's diagnosis from its metrics (flat user attributes): the first rule that applies.

    `config` only tailors the suggestions; `highest` (the study's highest measured limit) keeps a
    trial at its own settings' limit from reading as "only cheaper data or more cores help"."""
    facts = Facts.of(metrics, status, device_type, config or {}, highest)
    rule = next(rule for rule in RULES if rule.applies(facts))
    return rule.diagnose(facts)
