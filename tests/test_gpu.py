"""Real GPU tests (`pytest -m gpu`): the CUDA path on a real NVIDIA device. Skipped without CUDA.

What only a GPU can show: the CUDA-event step clock against a calibrated device sleep and against
host time, NVML against the real library, each precision (tf32, fp16 + GradScaler) running a trial,
a real CUDA out-of-memory and the trial after it, pinned memory with non_blocking copies, peak
memory from the caching allocator, MFU on a device with a documented peak, and CUDA_VISIBLE_DEVICES
pinning of a `python -m gpuopt.run` subprocess.

Trials are sized for a large GPU (an H200) and a short window: each takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpuopt.core.result import Status
from gpuopt.trial.devices import trial_device
from gpuopt.trial.prepare import load_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[1]

# A short window over a matmul-heavy MLP: big enough that a step is GPU work, not launch overhead.
GPU_TRIAL = [
    "device=cuda",
    "model=mlp",
    "model.width=4096",
    "model.depth=3",
    "loader.batch_size=512",
    "loader.num_workers=2",
    "data.size=8192",
    "data.sample_cost=0",
    "measure.warmup_steps=3",
    "measure.min_steps=10",
    "measure.max_steps=60",
    "measure.time_budget_s=2.0",
    "measure.min_time_s=0.2",
    "measure.ceiling_steps=10",
]


def run_trial_entry():
    """The public trial entry: gpuopt.engines.run_trial (the engine registry) where it exists,
    else gpuopt.trial.run_trial (before the engines restructure)."""
    try:
        from gpuopt.engines.registry import run_trial
    except ImportError:
        from gpuopt.trial import run_trial
    return run_trial


def run_gpu_trial(compose_cfg, *overrides, inspect=None):
    spec = load_spec(compose_cfg(*GPU_TRIAL, *overrides))
    device, warnings = trial_device(spec)
    result = run_trial_entry()(spec, device=device, inspect=inspect)
    result.warnings[:0] = warnings
    return result


def _host_timed_sleep(cycles: int) -> float:
    """Host seconds around one synchronized torch.cuda._sleep(cycles)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def sleep_cycles_per_second() -> float:
    """torch.cuda._sleep spins for a number of GPU clock cycles: calibrate cycles -> seconds on the
    host around a synchronized sleep long enough (~0.1 s) that launch and sync costs vanish."""
    cycles = 10_000_000
    _host_timed_sleep(cycles)  # first call: clocks ramp up
    while True:
        seconds = _host_timed_sleep(cycles)
        if seconds >= 0.1:
            return cycles / seconds
        cycles *= 4


def test_event_clock_times_a_calibrated_device_sleep():
    from gpuopt.trial.measure import CudaEventClock

    device = torch.device("cuda", torch.cuda.current_device())
    rate = sleep_cycles_per_second()
    step_s = 0.005
    clock = CudaEventClock(device)
    clock.start()
    for _ in range(40):
        torch.cuda._sleep(int(rate * step_s))  # queued: the host never waits inside the window
        clock.mark()
    times, wall = clock.finish()
    assert len(times) == 40
    median = sorted(times)[20]
    assert median == pytest.approx(step_s, rel=0.15)
    assert sum(times) == pytest.approx(wall, rel=0.1)  # the steps tile the window


def test_event_clock_counts_gpu_idle_time_against_host_time():
    """Events are reached when the GPU gets there: a step in which the GPU waits for the host
    (here: the host sleeps, the GPU has nothing queued) lasts what the host took."""
    from gpuopt.trial.measure import CudaEventClock, HostClock

    device = torch.device("cuda", torch.cuda.current_device())
    events, host = CudaEventClock(device), HostClock(sync=torch.cuda.synchronize)
    events.start()
    host.start()
    for _ in range(20):
        time.sleep(0.004)
        events.mark()
        host.mark()
    event_times, event_wall = events.finish()
    host_times, host_wall = host.finish()
    assert len(event_times) == len(host_times) == 20
    for on_device, on_host in zip(event_times, host_times, strict=True):
        assert on_device == pytest.approx(on_host, abs=0.002)
    assert event_wall == pytest.approx(host_wall, abs=0.01)
    # Completed intervals are read without blocking and do not change once read.
    assert events.completed_step_times() == event_times


def test_nvml_sampler_against_the_real_library():
    from gpuopt.trial import monitor

    device = torch.device("cuda", torch.cuda.current_device())
    sampler, note = monitor.open_sampler(device, 0.05)
    assert sampler is not None, note
    a = torch.randn(8192, 8192, device=device)
    sampler.start()
    deadline = time.perf_counter() + 1.5
    while time.perf_counter() < deadline:
        for _ in range(10):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    stats = sampler.stop()
    assert stats.samples >= 5
    assert stats.memory_used_mb is not None and stats.memory_used_mb > 256  # the 256 MB matrix
    assert stats.utilization is not None and 50 <= stats.utilization <= 100
    assert stats.utilization_source in (monitor.UTILIZATION_SAMPLED, monitor.UTILIZATION_POLLED)
    assert stats.power_w is not None and 20 < stats.power_w < 2000
    assert stats.energy_j is not None and stats.energy_j > 0
    if stats.energy_source == "counter":
        assert stats.power_source == monitor.POWER_COUNTER
        assert stats.power_w == pytest.approx(stats.energy_j / sampler.window_s)


@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp16", "bf16"])
def test_each_precision_runs_a_trial_with_its_flags(compose_cfg, mode):
    if mode == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    seen = {}

    def inspect(name, obj):
        if name == "workload":
            seen["precision"] = obj.precision
            seen["tf32"] = (
                torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32,
            )

    result = run_gpu_trial(compose_cfg, f"precision={mode}", inspect=inspect)
    assert result.status is Status.OK, result.reason
    m = result.metrics
    assert m.throughput > 0 and m.timed_steps >= 10 and m.step_time_ms > 0
    assert seen["tf32"] == ((mode == "tf32"),) * 2  # fp32 means fp32, cuDNN included
    scaler = seen["precision"].scaler
    assert (scaler is not None) == (mode == "fp16")
    if scaler is not None:
        assert scaler.is_enabled() and scaler.get_scale() > 0  # GradScaler ran the steps
    assert seen["precision"].autocast_dtype == {
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
    }.get(mode)


def test_cuda_oom_at_an_absurd_batch_then_the_next_trial_runs(compose_cfg):
    baseline = torch.cuda.memory_allocated()
    huge = run_gpu_trial(
        compose_cfg,
        "model=transformer",
        "model.width=2048",
        "model.depth=4",
        "model.heads=16",
        "loader.batch_size=16384",  # ~17 GB per activation tensor: far beyond any GPU
        "data.size=16384",
        "loader.num_workers=4",
    )
    assert huge.status is Status.OOM, huge.reason
    assert "out of memory" in (huge.reason or "").lower()
    # Memory is given back (the failed trial's blocks are released and the cache emptied) ...
    assert torch.cuda.memory_allocated() <= baseline + 2**20
    # ... and the next trial in this process runs normally.
    after = run_gpu_trial(compose_cfg)
    assert after.status is Status.OK, after.reason
    assert after.metrics.throughput > 0


def test_pinned_memory_and_non_blocking_copies(compose_cfg):
    seen = {}
    result = run_gpu_trial(
        compose_cfg,
        "loader.pin_memory=true",
        "loader.non_blocking=true",
        inspect=seen.__setitem__,
    )
    assert result.status is Status.OK, result.reason
    loader = seen["loader"]
    assert loader.pin_memory
    inputs, targets = next(iter(loader))
    assert inputs.is_pinned() and targets.is_pinned()
    on_device = seen["workload"].to_device(inputs, targets)
    assert all(t.is_cuda for t in on_device)
    torch.cuda.synchronize()
    assert torch.equal(on_device[0].cpu(), inputs)  # the asynchronous copy arrived whole
    assert 0 <= result.metrics.data_wait <= 100


def test_peak_memory_comes_from_the_allocator_with_explicit_cuda(compose_cfg):
    # device=cuda (not auto): the trial resets the allocator's peak before CUDA would otherwise be
    # initialized (pytorch#72404); resolve_device initializes it.
    seen = {}
    result = run_gpu_trial(compose_cfg, inspect=seen.__setitem__)  # GPU_TRIAL has device=cuda
    assert result.status is Status.OK, result.reason
    params_mb = sum(p.numel() * p.element_size() for p in seen["model"].parameters()) / 2**20
    peak = result.metrics.peak_memory_mb
    # weights + gradients + two AdamW moments at least, and no more than the allocator ever held
    assert 4 * params_mb <= peak <= torch.cuda.max_memory_allocated() / 2**20 + 1


def test_mfu_is_reported_on_a_gpu_with_a_documented_peak(compose_cfg):
    from gpuopt.trial.measure import peak_flops

    name = torch.cuda.get_device_name()
    if peak_flops(name, "bf16") is None:
        pytest.skip(f"no documented bf16 peak for {name}")
    result = run_gpu_trial(compose_cfg, "precision=bf16")
    assert result.status is Status.OK, result.reason
    m = result.metrics
    assert m.flops_per_sample and m.flops_per_sample > 0
    assert m.mfu is not None and 0 < m.mfu < 100


def _gpu_uuid(index: int) -> str:
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


@pytest.mark.parametrize("pin", ["uuid", "index"])
def test_cuda_visible_devices_pins_a_trial_subprocess(tmp_path, pin):
    index = torch.cuda.device_count() - 1  # the last GPU: on a multi-GPU machine, not cuda:0
    value = _gpu_uuid(index) if pin == "uuid" else str(index)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": value, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuopt.run",
            *GPU_TRIAL,
            "measure.ceiling=false",
            f"hydra.run.dir={tmp_path}",
            f"output_dir={tmp_path}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result_file,) = tmp_path.rglob("result.json")
    result = json.loads(result_file.read_text())
    assert result["status"] == "ok", result.get("reason")
    assert result["env"]["device"] == "cuda:0"  # the only GPU the trial sees
    assert result["env"]["device_name"] == torch.cuda.get_device_name(index)
    if result["metrics"].get("power_w") is not None:  # NVML followed the same GPU, by UUID
        assert result["metrics"]["utilization"] is not None
