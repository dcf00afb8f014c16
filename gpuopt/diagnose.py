"""Bottleneck diagnosis: what limits a trial's throughput, with the numbers that say so.

The rules read only measured metrics (see gpuopt/result.py, `Metrics`) and never guess past them:

1. input-bound       data_wait >= DATA_WAIT_HIGH_PCT or input_efficiency <= INPUT_EFFICIENCY_LOW_PCT
                     (the step waits for the next batch / the loader costs throughput vs. the
                     compute-only ceiling)
2. host/launch-bound (GPU) utilization < UTILIZATION_LOW_PCT without data wait: the GPU idles
                     between kernels because the CPU cannot issue them fast enough
3. memory-bound or   (GPU) utilization high but mfu < MFU_LOW_PCT: kernels run, but do little math
   small kernels     (bandwidth-bound elementwise ops, or kernels too small to fill the device)
4. near the limit    mfu >= MFU_HIGH_PCT: little left to gain from the same math
5. compute-bound     busy, mfu between the two thresholds - or on CPU, where utilization is derived
                     as 100 - data_wait and MFU is not measured ("MFU unknown")

Utilization only counts as evidence on CUDA devices, where it is NVML's sampled
`utilization.gpu`; elsewhere it is derived from data_wait and says nothing new.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# A step that spends this much of the timed window blocked on `next(loader)` is input-bound.
DATA_WAIT_HIGH_PCT = 10.0
# Throughput below this share of the compute-only ceiling (same step, batch already on the device)
# means the input pipeline costs throughput even when the wait is hidden in host-to-device copies.
INPUT_EFFICIENCY_LOW_PCT = 85.0
# NVML utilization below this (with no data wait) means gaps between kernels: host/launch overhead.
UTILIZATION_LOW_PCT = 80.0
# MFU (% of the device's dense peak for the dtype) below this on a busy GPU: memory-bound, or
# kernels too small to fill the device.
MFU_LOW_PCT = 20.0
# MFU at or above this is near what dense training reaches in practice.
MFU_HIGH_PCT = 50.0


NEAR_LIMIT_SUMMARY = (
    "MFU is close to what dense training reaches: little to gain from the same math"
)


class Bottleneck(str, Enum):
    INPUT = "input-bound"
    HOST = "host/launch-bound"
    MEMORY_OR_SMALL_KERNELS = "memory-bound or small kernels"
    NEAR_LIMIT = "near the compute limit"
    COMPUTE = "compute-bound"
    UNKNOWN = "unknown"  # the metrics needed for a verdict were not recorded
    NOT_MEASURED = "not measured"  # the trial did not finish a timed window (oom, diverged, error)


@dataclass
class Diagnosis:
    bottleneck: Bottleneck
    summary: str  # one sentence
    evidence: list[str] = field(default_factory=list)  # the numbers behind the verdict
    suggestions: list[str] = field(default_factory=list)  # what to try next, as config keys


def _number(metrics: Mapping[str, Any], name: str) -> float | None:
    value = metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _is_cuda(device_type: str | None) -> bool:
    return bool(device_type) and str(device_type).startswith("cuda")


def _input_suggestions(config: Mapping[str, Any], cuda: bool) -> list[str]:
    workers = _get(config, "loader.num_workers")
    tips = [
        f"more DataLoader workers: loader.num_workers (now {workers})"
        if workers is not None
        else "more DataLoader workers: loader.num_workers"
    ]
    if cuda and _get(config, "loader.pin_memory") is not True:
        tips.append("pinned memory + async copies: loader.pin_memory=true loader.non_blocking=true")
    if workers and _get(config, "loader.persistent_workers") is not True:
        tips.append("keep workers between epochs: loader.persistent_workers=true")
    tips.append("cheaper per-sample transforms, or pre-process/cache the dataset once")
    if not cuda:
        tips.append(
            "on CPU, loader workers share cores with compute: tune loader.num_workers "
            "and device.num_threads together"
        )
    return tips


def diagnose(
    metrics: Mapping[str, Any],
    *,
    status: str = "ok",
    device_type: str | None = None,
    config: Mapping[str, Any] | None = None,
) -> Diagnosis:
    """Diagnose one trial from its metrics (flat user attributes), status and device type.

    `device_type` is "cuda", "cuda:N", "cpu", "mps" or None (unknown); `config` (the resolved trial
    config) only tailors the suggestions.
    """
    config = config or {}
    if status != "ok":
        return Diagnosis(Bottleneck.NOT_MEASURED, f"no timed window: the trial ended as {status}")

    data_wait = _number(metrics, "data_wait")
    input_eff = _number(metrics, "input_efficiency")
    utilization = _number(metrics, "utilization")
    mfu = _number(metrics, "mfu")
    throughput = _number(metrics, "throughput")
    ceiling = _number(metrics, "ceiling_throughput")
    cuda = _is_cuda(device_type)
    evidence: list[str] = []

    if data_wait is not None:
        evidence.append(
            f"data_wait {data_wait:.1f}% of the timed window "
            f"(input-bound at >= {DATA_WAIT_HIGH_PCT:g}%)"
        )
    if input_eff is not None:
        vs = (
            f" ({throughput:,.0f} vs ceiling {ceiling:,.0f} samples/s)"
            if throughput and ceiling
            else ""
        )
        evidence.append(
            f"input_efficiency {input_eff:.1f}%{vs} "
            f"(input-bound at <= {INPUT_EFFICIENCY_LOW_PCT:g}%)"
        )
    if data_wait is None and input_eff is None:
        evidence.append("no data_wait or input_efficiency recorded")
        return Diagnosis(
            Bottleneck.UNKNOWN, "cannot tell whether the input pipeline limits throughput", evidence
        )

    if (data_wait is not None and data_wait >= DATA_WAIT_HIGH_PCT) or (
        input_eff is not None and input_eff <= INPUT_EFFICIENCY_LOW_PCT
    ):
        return Diagnosis(
            Bottleneck.INPUT,
            "the step waits for data: the input pipeline limits throughput",
            evidence,
            _input_suggestions(config, cuda),
        )

    mfu_text = (
        f"mfu {mfu:.1f}% of peak"
        if mfu is not None
        else "MFU unknown (not measured on this device)"
    )
    if not cuda:
        # CPU (or an unknown device): utilization is 100 - data_wait, so it adds no evidence.
        evidence.append(mfu_text)
        if mfu is not None and mfu >= MFU_HIGH_PCT:
            return Diagnosis(
                Bottleneck.NEAR_LIMIT,
                NEAR_LIMIT_SUMMARY,
                evidence,
                ["less work per sample (smaller model, fewer FLOPs) is what is left"],
            )
        where = "CPU" if device_type == "cpu" else f"device {device_type or 'unknown'}"
        return Diagnosis(
            Bottleneck.COMPUTE,
            f"the training step itself limits throughput on {where}; "
            + ("MFU unknown, no finer diagnosis" if mfu is None else "no single cause stands out"),
            evidence,
            ["compute threads: device.num_threads", "larger batch: loader.batch_size"],
        )

    if utilization is None:
        evidence.append("GPU utilization not recorded")
    else:
        evidence.append(
            f"GPU utilization {utilization:.1f}% (NVML; host-bound below {UTILIZATION_LOW_PCT:g}%)"
        )
    evidence.append(
        mfu_text
        + (
            f" (low < {MFU_LOW_PCT:g}%, near the limit >= {MFU_HIGH_PCT:g}%)"
            if mfu is not None
            else ""
        )
    )

    if utilization is not None and utilization < UTILIZATION_LOW_PCT:
        tips = []
        if _get(config, "compile.mode") in (None, "off", "default"):
            tips.append(
                "fewer kernel launches: compile=reduce-overhead (torch.compile + CUDA graphs)"
            )
        tips.append("more work per launch: larger loader.batch_size")
        if _get(config, "optimizer.fused") is not True:
            tips.append("fused optimizer step: optimizer.fused=true")
        return Diagnosis(
            Bottleneck.HOST,
            "the GPU idles between kernels without waiting for data: "
            "host/launch overhead limits throughput",
            evidence,
            tips,
        )
    if mfu is None:
        return Diagnosis(
            Bottleneck.COMPUTE,
            "the GPU is busy; MFU unknown, so memory-bound and near-the-limit cannot be told apart",
            evidence,
        )
    if mfu >= MFU_HIGH_PCT:
        return Diagnosis(
            Bottleneck.NEAR_LIMIT,
            NEAR_LIMIT_SUMMARY,
            evidence,
            ["less work per sample is what is left (lower precision if not yet, smaller model)"],
        )
    if mfu < MFU_LOW_PCT:
        if utilization is None:
            return Diagnosis(
                Bottleneck.UNKNOWN,
                "low MFU, but without utilization host-bound and memory-bound cannot be told apart",
                evidence,
            )
        tips = []
        if _get(config, "precision.mode") in (None, "fp32", "tf32"):
            tips.append("half the bytes per value: precision=bf16 (or fp16)")
        if (
            _get(config, "model.input") == "images"
            and _get(config, "model.channels_last") is not True
        ):
            tips.append("NHWC convolutions: model.channels_last=true")
        tips.append("bigger kernels: larger loader.batch_size")
        if _get(config, "compile.mode") in (None, "off"):
            tips.append("fuse elementwise ops: compile=default")
        return Diagnosis(
            Bottleneck.MEMORY_OR_SMALL_KERNELS,
            "the GPU is busy but does little math: memory-bound or small kernels",
            evidence,
            tips,
        )
    return Diagnosis(
        Bottleneck.COMPUTE,
        "the GPU is busy with useful math; no single cause stands out",
        evidence,
        ["larger loader.batch_size or lower precision may still help"],
    )
