"""The two GPM bottleneck rules (gpuopt/report/diagnose.py) on scripted Hopper trials: a
launch-bound configuration that reads busy with idle SMs, and an fp32 matmul-heavy step whose
tensor cores sit idle. Each verdict cites the metric values it read."""

from __future__ import annotations

from gpuopt.report.diagnose import (
    MATMUL_HEAVY_MFU_PCT,
    SM_ACTIVE_LOW_PCT,
    TENSOR_ACTIVE_LOW_PCT,
    Bottleneck,
    diagnose,
)

# The mlp at micro-batch 32 as a launch-bound Hopper reads it: util.gpu 97%, 9% of SMs busy.
LAUNCH_BOUND = {
    "utilization": 97.0,
    "sm_active": 9.0,
    "sm_occupancy": 3.5,
    "tensor_active": 0.4,
    "dram_bw_util": 2.0,
    "mfu": 0.8,
    "data_wait": 0.5,
    "input_efficiency": 99.0,
    "compute_dtype": "bf16",
}
# A matmul-heavy transformer step at fp32: SMs busy, tensor pipes idle.
FP32_MATMUL = {
    "utilization": 99.0,
    "sm_active": 93.0,
    "sm_occupancy": 40.0,
    "tensor_active": 0.0,
    "dram_bw_util": 35.0,
    "mfu": 38.0,
    "data_wait": 0.2,
    "input_efficiency": 99.0,
    "compute_dtype": "fp32",
}
MLP = {"model": {"input": "vector"}, "compile": {"mode": "off"}, "optimizer": {"fused": False}}
CNN = {"model": {"input": "images", "channels_last": False}, "compile": {"mode": "off"}}


def test_busy_gpu_with_idle_sms_is_launch_bound_citing_both_utilizations():
    d = diagnose(LAUNCH_BOUND, device_type="cuda", config=MLP)
    assert d.bottleneck is Bottleneck.HOST
    assert d.summary == (
        "the GPU reads busy (util.gpu 97%) but its SMs are active 9%: kernels too small or "
        "launch-bound"
    )
    assert any(e.startswith("GPU utilization 97.0% (NVML util.gpu") for e in d.evidence)
    assert f"SM activity 9.0% (GPM: the share of SMs busy); low below {SM_ACTIVE_LOW_PCT:g}%" in (
        d.evidence
    )
    assert any(e.startswith("SM occupancy 3.5%") for e in d.evidence)
    tips = " | ".join(d.suggestions)
    assert "larger loader.batch_size" in tips and "compile=reduce-overhead" in tips
    assert "optimizer.fused=true" in tips and "channels_last" not in tips
    conv = diagnose(LAUNCH_BOUND, device_type="cuda", config=CNN)
    assert any("model.channels_last=true" in tip for tip in conv.suggestions)


def test_the_same_numbers_without_gpm_read_as_before():
    without = {k: v for k, v in LAUNCH_BOUND.items() if k not in ("sm_active", "sm_occupancy")}
    d = diagnose(without, device_type="cuda", config=MLP)
    assert d.bottleneck is Bottleneck.MEMORY_OR_SMALL_KERNELS  # util.gpu alone: busy, low MFU
    assert not any("SM activity" in e for e in d.evidence)


def test_sms_busy_enough_or_util_low_is_not_the_gpm_rule():
    busy = {**LAUNCH_BOUND, "sm_active": SM_ACTIVE_LOW_PCT}
    assert "SMs are active" not in diagnose(busy, device_type="cuda", config=MLP).summary
    idle = {**LAUNCH_BOUND, "utilization": 40.0}  # util.gpu already says it: the host-bound rule
    d = diagnose(idle, device_type="cuda", config=MLP)
    assert d.bottleneck is Bottleneck.HOST and "SMs are active" not in d.summary
    assert "SM activity 9.0% (GPM: the share of SMs busy)" in d.evidence  # still cited
    assert diagnose(LAUNCH_BOUND, device_type="cpu", config=MLP).bottleneck is Bottleneck.COMPUTE


def test_idle_tensor_cores_in_an_fp32_matmul_heavy_step_suggest_bf16_or_tf32():
    d = diagnose(FP32_MATMUL, device_type="cuda", config=MLP)
    assert d.bottleneck is Bottleneck.COMPUTE
    assert d.summary == (
        "the tensor cores sit idle (tensor-core activity 0.0%) in a matmul-heavy step at fp32 "
        "(mfu 38% of the fp32 peak): bf16 or tf32 runs its matmuls on them"
    )
    assert (
        f"tensor-core activity 0.0% (GPM: tensor pipes busy); idle below "
        f"{TENSOR_ACTIVE_LOW_PCT:g}%" in d.evidence
    )
    assert "compute dtype fp32" in d.evidence
    assert any(e.startswith("mfu 38.0% of peak (matmul-heavy at >=") for e in d.evidence)
    (tip,) = d.suggestions
    assert "precision=bf16" in tip and "precision=tf32" in tip


def test_the_tensor_rule_needs_fp32_a_matmul_heavy_step_and_idle_pipes():
    def verdict(**change):
        return diagnose({**FP32_MATMUL, **change}, device_type="cuda", config=MLP).summary

    assert "tensor cores sit idle" in verdict()
    assert "tensor cores sit idle" not in verdict(compute_dtype="bf16")
    assert "tensor cores sit idle" not in verdict(compute_dtype="tf32")
    assert "tensor cores sit idle" not in verdict(mfu=MATMUL_HEAVY_MFU_PCT / 2)
    assert "tensor cores sit idle" not in verdict(tensor_active=TENSOR_ACTIVE_LOW_PCT)
    assert "tensor cores sit idle" not in verdict(tensor_active=None)
    no_dtype = {k: v for k, v in FP32_MATMUL.items() if k != "compute_dtype"}
    fp32_config = {**MLP, "precision": {"mode": "fp32"}}
    assert (
        "tensor cores sit idle"
        in diagnose(no_dtype, device_type="cuda", config=fp32_config).summary
    )
