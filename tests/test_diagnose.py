"""Bottleneck rules: each verdict from the metrics that support it, and none the metrics cannot."""

from __future__ import annotations

import pytest

from gpuopt.report.diagnose import Bottleneck, diagnose
from gpuopt.report.evidence import (
    DATA_WAIT_HIGH_PCT,
    INPUT_EFFICIENCY_LOW_PCT,
    MFU_HIGH_PCT,
    MFU_LOW_PCT,
    UTILIZATION_LOW_PCT,
)

CPU_CONFIG = {"loader": {"num_workers": 0, "pin_memory": False}, "precision": {"mode": "fp32"}}


def gpu(utilization, mfu, data_wait=1.0, input_efficiency=98.0):
    return {
        "utilization": utilization,
        "mfu": mfu,
        "data_wait": data_wait,
        "input_efficiency": input_efficiency,
    }


@pytest.mark.parametrize(
    ("metrics", "device", "expected"),
    [
        # input-bound from either signal
        (
            {"data_wait": 42.0, "input_efficiency": 55.0, "utilization": 58.0},
            "cpu",
            Bottleneck.INPUT,
        ),
        ({"data_wait": DATA_WAIT_HIGH_PCT, "input_efficiency": 99.0}, "cpu", Bottleneck.INPUT),
        (
            {"data_wait": 2.0, "input_efficiency": INPUT_EFFICIENCY_LOW_PCT},
            "cuda",
            Bottleneck.INPUT,
        ),
        ({"data_wait": 30.0}, None, Bottleneck.INPUT),
        # GPU: utilization and MFU decide
        (gpu(UTILIZATION_LOW_PCT - 0.1, 3.0), "cuda", Bottleneck.HOST),
        (gpu(97.0, MFU_LOW_PCT - 0.1), "cuda", Bottleneck.MEMORY_OR_SMALL_KERNELS),
        (gpu(99.0, MFU_HIGH_PCT), "cuda", Bottleneck.NEAR_LIMIT),
        (gpu(99.0, (MFU_LOW_PCT + MFU_HIGH_PCT) / 2), "cuda", Bottleneck.COMPUTE),
        (gpu(95.0, None), "cuda", Bottleneck.COMPUTE),  # busy, MFU unknown: no finer verdict
        (
            gpu(None, 5.0),
            "cuda",
            Bottleneck.UNKNOWN,
        ),  # low MFU without utilization: host or memory?
        # CPU: utilization = 100 - data_wait is no evidence, even when it reads low
        (
            {"data_wait": 2.0, "input_efficiency": 97.0, "utilization": 40.0, "mfu": None},
            "cpu",
            Bottleneck.COMPUTE,
        ),
        # nothing to decide from
        ({"throughput": 100.0}, "cpu", Bottleneck.UNKNOWN),
    ],
)
def test_verdicts(metrics, device, expected):
    assert diagnose(metrics, device_type=device).bottleneck is expected


def test_input_bound_evidence_names_the_numbers_and_fitting_fixes():
    d = diagnose(
        {
            "data_wait": 42.0,
            "input_efficiency": 55.0,
            "throughput": 1000.0,
            "ceiling_throughput": 1818.0,
        },
        device_type="cuda",
        config=CPU_CONFIG,
    )
    text = " ".join(d.evidence)
    assert "42.0%" in text and "55.0%" in text and "1,818" in text
    assert any("loader.num_workers (now 0)" in s for s in d.suggestions)
    assert any("pin_memory" in s for s in d.suggestions)
    # already pinned: not suggested again
    pinned = {"loader": {"num_workers": 4, "pin_memory": True}}
    d2 = diagnose({"data_wait": 42.0}, device_type="cuda", config=pinned)
    assert not any("pin_memory" in s for s in d2.suggestions)
    assert any("persistent_workers" in s for s in d2.suggestions)


def test_cpu_says_mfu_unknown_and_never_uses_utilization():
    d = diagnose(
        {"data_wait": 1.0, "input_efficiency": 99.0, "utilization": 99.0, "mfu": None},
        device_type="cpu",
    )
    assert "MFU unknown" in d.summary
    assert not any("utilization" in e.lower() for e in d.evidence)
    assert not any("compile" in s for s in d.suggestions)  # no GPU advice for a CPU trial


def test_host_bound_suggests_cuda_graphs_unless_already_compiled():
    d = diagnose(gpu(45.0, 4.0), device_type="cuda:1", config={"compile": {"mode": "off"}})
    assert d.bottleneck is Bottleneck.HOST
    assert any("45.0%" in e for e in d.evidence)
    assert any("reduce-overhead" in s for s in d.suggestions)
    compiled = diagnose(
        gpu(45.0, 4.0), device_type="cuda", config={"compile": {"mode": "reduce-overhead"}}
    )
    assert not any("reduce-overhead" in s for s in compiled.suggestions)


def test_memory_bound_suggests_bf16_and_channels_last_for_images_in_fp32():
    config = {"precision": {"mode": "fp32"}, "model": {"input": "images", "channels_last": False}}
    d = diagnose(gpu(97.0, 8.0), device_type="cuda", config=config)
    assert any("bf16" in s for s in d.suggestions)
    assert any("channels_last" in s for s in d.suggestions)
    bf16 = diagnose(gpu(97.0, 8.0), device_type="cuda", config={"precision": {"mode": "bf16"}})
    assert not any("precision=bf16" in s for s in bf16.suggestions)


@pytest.mark.parametrize("status", ["oom", "diverged", "error"])
def test_failed_trials_are_not_diagnosed(status):
    d = diagnose({"data_wait": 90.0}, status=status, device_type="cpu")
    assert d.bottleneck is Bottleneck.NOT_MEASURED and status in d.summary


def test_nan_metrics_count_as_missing():
    assert diagnose({"data_wait": float("nan")}, device_type="cpu").bottleneck is Bottleneck.UNKNOWN


def test_gpu_input_bound_reads_starvation_not_the_hosts_loader_time():
    # A GPU-bound step whose loader runs while the GPU computes: the host waited 40% of the window,
    # the GPU starved 1%. Not input-bound (the rule reads data_wait, the GPU timeline's number).
    overlapped = {**gpu(utilization=97.0, mfu=35.0, data_wait=1.0), "host_data_wait": 40.0}
    assert diagnose(overlapped, device_type="cuda").bottleneck is Bottleneck.COMPUTE
    starved = {**gpu(utilization=60.0, mfu=10.0, data_wait=30.0), "host_data_wait": 32.0}
    d = diagnose(starved, device_type="cuda")
    assert d.bottleneck is Bottleneck.INPUT
    assert any("data_wait 30.0%" in e and "GPU starved" in e for e in d.evidence)


def test_cpu_input_bound_reads_the_hosts_wait_which_is_the_same_thing_there():
    assert diagnose({"host_data_wait": 40.0}, device_type="cpu").bottleneck is Bottleneck.INPUT
    # On a GPU the host's wait alone says nothing about starvation.
    assert diagnose({"host_data_wait": 40.0}, device_type="cuda").bottleneck is Bottleneck.UNKNOWN


@pytest.mark.parametrize(
    ("bound", "device", "says"),
    [
        ("cores", "cpu", "only cheaper data or more cores help"),
        ("loader", "cuda", "only cheaper data or more cores help"),
        ("compute", "cuda", "only less math per sample or a faster device help"),
    ],
)
def test_at_the_machines_limit_comes_first_and_says_what_is_left(bound, device, says):
    from gpuopt.report.evidence import LIMIT_HIGH_PCT

    metrics = {
        "data_wait": 40.0,  # input-bound too: the limit says more workers cannot help
        "input_efficiency": 50.0,
        "limit_efficiency": 96.0,
        "limit_throughput": 10_000.0,
        "limit_bound": bound,
    }
    d = diagnose(metrics, device_type=device)
    assert d.bottleneck is Bottleneck.AT_MACHINE_LIMIT
    assert d.summary.startswith("at 96% of this machine's limit") and says in d.summary
    assert any("limit_efficiency 96.0%" in line for line in d.evidence)
    below = diagnose({**metrics, "limit_efficiency": LIMIT_HIGH_PCT - 1}, device_type=device)
    assert below.bottleneck is Bottleneck.INPUT


def test_at_its_own_settings_limit_points_at_settings_with_a_higher_one():
    """A baseline at 100% of its own settings' limit, where another trial's settings measured 2.7x
    that: not "only cheaper data or more cores help" - the settings first."""
    from gpuopt.core.limits import HighestLimit

    metrics = {"throughput": 2612.0, "data_wait": 48.0, "input_efficiency": 50.0,
               "limit_efficiency": 99.7, "limit_throughput": 2621.0, "limit_bound": "cores"}  # fmt: skip
    alone = diagnose(metrics, device_type="cpu")
    assert "only cheaper data or more cores help" in alone.summary
    in_study = diagnose(metrics, device_type="cpu", highest=HighestLimit(7173.0, "cores", 1))
    assert in_study.bottleneck is Bottleneck.AT_MACHINE_LIMIT
    assert "other settings measured a higher limit (7,173 samples/s, trial #1)" in in_study.summary
    assert "only cheaper data" not in in_study.summary
    assert any("trial #1's settings, the highest" in line for line in in_study.evidence)
    assert in_study.suggestions[0].startswith("the settings of trial #1")
    near = diagnose(metrics, device_type="cpu", highest=HighestLimit(2700.0, "cores", 1))
    assert near.summary == alone.summary  # within 5%: the same limit, measured twice
