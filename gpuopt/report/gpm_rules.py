"""The bottleneck rules that read GPM (NVML GPU Performance Monitoring, Hopper and newer): what
`utilization` (NVML's `utilization.gpu`: a kernel was running) cannot tell apart. Busy but idle
SMs: the GPU reads busy, yet most SMs do nothing (kernels too small to fill it, or launched no
faster than they run). Tensor cores idle in a matmul-heavy fp32 step: bf16 or tf32 runs those
matmuls on them.
"""

from __future__ import annotations

from gpuopt.core import knobs
from gpuopt.report.evidence import (
    UTILIZATION_LOW_PCT,
    Facts,
    _mfu_text,
    _uncompiled,
    gpm_lines,
    input_evidence,
)

# SM activity (GPM: % of SMs busy over the window) below this on a GPU that reads busy: small or
# launch-bound kernels. A step of large kernels keeps most SMs busy while it runs.
SM_ACTIVE_LOW_PCT = 50.0
# Tensor-pipe activity (GPM) below this: the tensor cores sit idle.
TENSOR_ACTIVE_LOW_PCT = 5.0
# A step whose counted matmul/convolution FLOPs reach this share of the fp32 peak (its mfu at
# fp32) spends much of its time in matmuls: the work tensor cores do.
MATMUL_HEAVY_MFU_PCT = 10.0


def busy_but_idle_sms(f: Facts) -> bool:
    return (
        f.cuda
        and f.sm_active is not None
        and f.utilization is not None
        and f.utilization >= UTILIZATION_LOW_PCT
        and f.sm_active < SM_ACTIVE_LOW_PCT
    )


def idle_sms_summary(f: Facts) -> str:
    return (
        f"the GPU reads busy (util.gpu {f.utilization:.0f}%) but its SMs are active "
        f"{f.sm_active:.0f}%: kernels too small or launch-bound"
    )


def idle_sms_evidence(f: Facts) -> list[str]:
    return [
        *input_evidence(f),
        f"GPU utilization {f.utilization:.1f}% (NVML util.gpu: a kernel was running; busy at >= "
        f"{UTILIZATION_LOW_PCT:g}%)",
        *(
            f"{line}; low below {SM_ACTIVE_LOW_PCT:g}%" if line.startswith("SM activity") else line
            for line in gpm_lines(f)
        ),
        _mfu_text(f),
    ]


def idle_sms_suggestions(f: Facts) -> list[str]:
    tips = [f"more work per kernel: {knobs.MICRO_BATCH.tip}"]
    if _uncompiled(f, "default"):
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


def idle_tensor_cores(f: Facts) -> bool:
    return (
        f.cuda
        and f.tensor_active is not None
        and f.tensor_active < TENSOR_ACTIVE_LOW_PCT
        and f.mfu is not None
        and f.mfu >= MATMUL_HEAVY_MFU_PCT
        and _fp32(f)
    )


def idle_tensor_summary(f: Facts) -> str:
    return (
        f"the tensor cores sit idle (tensor-core activity {f.tensor_active:.1f}%) in a "
        f"matmul-heavy step at fp32 (mfu {f.mfu:.0f}% of the fp32 peak): bf16 or tf32 runs its "
        "matmuls on them"
    )


def idle_tensor_evidence(f: Facts) -> list[str]:
    return [
        *input_evidence(f),
        *(
            f"{line}; idle below {TENSOR_ACTIVE_LOW_PCT:g}%" if line.startswith("tensor") else line
            for line in gpm_lines(f)
        ),
        f"compute dtype {f.compute_dtype or 'fp32'}",
        f"{_mfu_text(f)} (matmul-heavy at >= {MATMUL_HEAVY_MFU_PCT:g}% of the fp32 peak)",
    ]


def idle_tensor_suggestions(f: Facts) -> list[str]:
    group = knobs.PRECISION.group
    return [
        f"tensor cores: {knobs.PRECISION.tip}, or {group}=tf32 (fp32 storage, tf32 matmuls); "
        "the numerics guard checks either against fp32"
    ]
