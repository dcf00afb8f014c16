"""gpuopt's precision modes and Lightning's precision strings: what `Trainer(precision=...)` a
trial's precision group maps to, and which dtype's peak its MFU is measured against. torch-free.
"""

from __future__ import annotations

from gpuopt.core.spec import TrialSpec

# gpuopt precision mode -> Lightning `Trainer(precision=...)`.
PRECISION_TO_LIGHTNING = {
    "fp32": "32-true",
    "tf32": "32-true",
    "bf16": "bf16-mixed",
    "fp16": "16-mixed",
}
# Lightning precision string -> the dtype whose documented peak MFU is measured against.
PEAK_MODE = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


def lightning_precision(spec: TrialSpec) -> str:
    """The Trainer's precision: `engine.precision`, else the precision group's mapping."""
    return spec.engine.precision or PRECISION_TO_LIGHTNING[spec.precision.mode]


def peak_mode(spec: TrialSpec) -> str | None:
    """The precision mode for MFU's peak of the precision the fit runs; None without a peak."""
    precision = lightning_precision(spec)
    if precision == "32-true":
        # float32 math: TF32 tensor cores only where precision.mode=tf32 set the matmul precision
        # to "high" (a bf16/fp16 precision.mode overridden by "32-true" runs plain fp32).
        return "tf32" if spec.precision.mode == "tf32" else "fp32"
    return PEAK_MODE.get(precision)
