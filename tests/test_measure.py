"""Measurement mechanics: the stability stop, batch-means CI, step statistics, MFU, FLOP counting,
process start time. Step times are synthetic where the rule, not the machine, is under test."""

from __future__ import annotations

import itertools
import math
import os
import random
import time
from pathlib import Path

import pytest
import torch

from gpuopt.engines._lifecycle import process_start_time
from gpuopt.trial.measure import (
    HostClock,
    StopRule,
    measure_step_flops,
    mfu_percent,
    next_stop_check,
    peak_flops,
    relative_ci_halfwidth,
    step_stats,
)

RULE = StopRule(min_steps=10, max_steps=200, time_budget_s=5.0, stability_target=0.03)


def test_stable_step_times_stop_as_stable_once_there_are_enough_batch_means():
    times = [0.010 * (1 + 0.001 * (i % 3)) for i in range(15)]
    assert RULE.check(times, elapsed_s=0.1) == "stable"  # 5 batch means of 3 steps
    assert RULE.check(times[:14], elapsed_s=0.1) is None  # 4 batch means: no CI yet
    assert StopRule(20, 200, 5.0, 0.03).check(times, elapsed_s=0.1) is None  # not before min_steps


def test_noisy_step_times_run_to_the_budget():
    rng = random.Random(0)
    times = [0.010 * rng.lognormvariate(0, 0.6) for _ in range(40)]
    assert relative_ci_halfwidth(times) > RULE.stability_target
    assert RULE.check(times, elapsed_s=1.0) is None  # keep measuring
    assert RULE.check(times, elapsed_s=5.0) == "budget"
    assert RULE.check(times * 5, elapsed_s=1.0) == "max_steps"


def test_ci_uses_batch_means_so_drift_is_not_mistaken_for_stability():
    # Alternating jitter averages out inside each batch: stable.
    alternating = [0.010 if i % 2 else 0.012 for i in range(100)]
    assert relative_ci_halfwidth(alternating) == pytest.approx(0.0, abs=1e-12)
    # A slow drift of +-5% with tiny step-to-step jitter is not stable: raw-step statistics would
    # treat the steps as independent and understate the uncertainty.
    drifting = [0.010 * (1 + 0.05 * math.sin(i / 15)) for i in range(100)]
    mean = sum(drifting) / 100
    sd = math.sqrt(sum((t - mean) ** 2 for t in drifting) / 99)
    naive = 1.984 * sd / math.sqrt(100) / mean  # raw steps taken as independent
    assert naive < 0.01
    assert relative_ci_halfwidth(drifting) > 0.02


def test_ci_matches_the_batch_means_formula():
    times = [float(i % 7 + 1) for i in range(50)]  # 10 batches of 5
    means = [sum(times[b * 5 : b * 5 + 5]) / 5 for b in range(10)]
    mean = sum(means) / 10
    sd = math.sqrt(sum((m - mean) ** 2 for m in means) / 9)
    assert relative_ci_halfwidth(times) == pytest.approx(
        2.2621571628 * sd / math.sqrt(10) / mean
    )  # t(0.975, 9)
    assert relative_ci_halfwidth(times[:4]) is None  # too few steps for a CI
    # Any sequence of step times: a tuple, an array (the CUDA clock's, the distributed ranks').
    assert relative_ci_halfwidth(tuple(times)) == relative_ci_halfwidth(times)
    assert relative_ci_halfwidth(torch.tensor(times).numpy()) == pytest.approx(
        relative_ci_halfwidth(times)
    )


def test_step_stats_median_percentiles_and_cv():
    stats = step_stats([i / 1000 for i in range(1, 11)])  # 1..10 ms
    assert (stats.median_ms, stats.p10_ms, stats.p90_ms) == pytest.approx((5.5, 1.9, 9.1))
    assert stats.cv == pytest.approx(3.0276503540974917 / 5.5)


def run_window(step, clock, rule):
    """gpuopt's one window meter (gpuopt.engines._meter) over `step(i)`, no warm-up, on `clock`
    and `rule`: its WindowResult."""
    import dataclasses

    from gpuopt.core.spec import EngineConf, MeasureConf
    from gpuopt.engines._lifecycle import measuring_spec
    from gpuopt.engines._meter import WindowMeter
    from gpuopt.trial.context import Trial

    cpu = torch.device("cpu")
    measure = dataclasses.replace(MeasureConf(), warmup_steps=0, count_flops=False)
    meter = WindowMeter(Trial(measuring_spec(cpu, measure, EngineConf(name="user_step")), cpu))
    meter.clock, meter.rule = clock, rule
    index = itertools.count()
    meter.run(lambda: (step(next(index)), 1)[1])
    return meter.window


def ScriptedClock(step_times, sync=None):
    """The host clock reading step boundaries from a script instead of the wall clock."""
    boundaries = itertools.accumulate(step_times, initial=0.0)
    return HostClock(sync=sync, timer=lambda: next(boundaries))


def test_window_stops_stable_on_steady_steps_and_at_max_steps_on_noisy_ones():
    steady = run_window(lambda i: None, ScriptedClock([0.01] * 100), RULE)
    assert (steady.stop_reason, steady.steps, len(steady.step_times)) == ("stable", 15, 15)
    assert steady.wall_s == pytest.approx(0.15)
    rng = random.Random(1)
    noisy = [0.01 * rng.lognormvariate(0, 0.8) for _ in range(300)]
    rule = StopRule(min_steps=10, max_steps=50, time_budget_s=60.0, stability_target=0.01)
    result = run_window(lambda i: None, ScriptedClock(noisy), rule)
    assert (result.stop_reason, result.steps) == ("max_steps", 50)


class CountingRule:
    """A StopRule that counts how often the window reads it (what the stop decision costs)."""

    def __init__(self, rule):
        self.rule, self.reads = rule, []
        self.min_steps, self.max_steps = rule.min_steps, rule.max_steps
        self.time_budget_s = rule.time_budget_s

    def check(self, step_times, elapsed_s, steps=None):
        self.reads.append(steps)
        return self.rule.check(step_times, elapsed_s, steps)


def test_the_window_stops_within_a_twentieth_of_the_steps_after_it_became_stable():
    """The CI is read at min_steps, then each time the steps grew by 5%: the window stops at a
    read where the rule says stable, at most max(1, n // 20) steps after the step n from which it
    stays stable; it reads the rule on that schedule, not once per step."""
    rng = random.Random(3)
    times = [0.01 * rng.lognormvariate(0, 0.3) for _ in range(100)] + [0.01] * 900
    rule = StopRule(min_steps=10, max_steps=5000, time_budget_s=math.inf, stability_target=0.03)
    stable = [rule.check(times[:n], 0.0) == "stable" for n in range(len(times) + 1)]
    first = stable.index(True)
    settled = next(n for n in range(first, 1000) if all(stable[n:]))  # stable from here on
    assert 150 < first < settled < 900  # the noisy start keeps it unstable for a while
    counting = CountingRule(rule)
    result = run_window(lambda i: None, ScriptedClock(times), counting)
    assert result.stop_reason == "stable" and stable[result.steps]
    assert first <= result.steps <= settled + max(1, settled // 20)
    assert counting.reads[:12] == list(range(10, 22))  # every step until 5% is more than one
    assert all(b == next_stop_check(a) for a, b in itertools.pairwise(counting.reads))
    assert len(counting.reads) < result.steps / 3  # 75 reads in 279 steps


def test_the_host_clock_keeps_each_step_and_a_synced_finish_extends_the_last_one():
    synced = []
    clock = ScriptedClock([1.0, 1.0, 1.0, 0.5], sync=lambda: synced.append(True))
    clock.start()
    for _ in range(3):
        clock.mark()
    assert clock.completed_step_times() == [1.0, 1.0, 1.0]
    clock.completed_step_times().append(9.0)  # a copy: the stop rule cannot change the clock
    times, wall = clock.finish()  # the device's queue done half a second after the last mark
    assert (times, wall, len(synced)) == ([1.0, 1.0, 1.5], 3.5, 2)


def test_window_stops_at_the_real_time_budget():
    rule = StopRule(min_steps=5, max_steps=10_000, time_budget_s=0.05, stability_target=1e-9)
    calls = []
    started = time.perf_counter()
    result = run_window(lambda i: (calls.append(i), time.sleep(0.005)), HostClock(), rule)
    assert result.stop_reason == "budget"
    assert result.steps == len(calls) == len(result.step_times)
    assert calls == list(range(result.steps))
    assert 0.05 <= result.wall_s <= time.perf_counter() - started


@pytest.mark.parametrize(
    ("name", "mode", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "fp16", 756.0),
        ("NVIDIA H200", "tf32", 494.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A10", "fp32", 31.2),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "bf16", 362.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ],
)
def test_peak_flops_lookup(name, mode, tflops):
    assert peak_flops(name, mode) == pytest.approx(tflops * 1e12)


def test_peak_flops_unknown_is_none():
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert peak_flops("AMD EPYC", "fp32") is None
    assert peak_flops(None, "fp32") is None
    assert mfu_percent(1e9, 1000.0, None) is None


def test_mfu_is_achieved_over_peak_flops():
    assert mfu_percent(flops_per_sample=1e9, throughput=1000.0, peak=1e14) == pytest.approx(1.0)


def test_flop_counter_counts_forward_and_backward_matmuls():
    layer = torch.nn.Linear(16, 32)
    x = torch.randn(4, 16)
    flops = measure_step_flops(lambda: layer(x).sum().backward()).hardware
    assert flops == 2 * (2 * 4 * 16 * 32)  # forward + weight gradient (x needs no gradient)


def test_process_start_time_agrees_with_proc_stat_btime():
    start = process_start_time()
    assert start is not None and start < time.time()
    # Independent estimate: boot time (1 s resolution) + start ticks.
    stat = Path("/proc/stat").read_text().splitlines()
    btime = next(int(line.split()[1]) for line in stat if line.startswith("btime"))
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    assert start == pytest.approx(btime + ticks / os.sysconf("SC_CLK_TCK"), abs=1.5)


def test_stability_stop_waits_for_min_time():
    """Stable step times stop the window only once it has lasted min_time_s (capped at the budget)."""
    times = [0.010 * (1 + 0.001 * (i % 3)) for i in range(30)]
    rule = StopRule(
        min_steps=10, max_steps=200, time_budget_s=5.0, stability_target=0.03, min_time_s=2.0
    )
    assert rule.check(times, elapsed_s=0.3) is None
    assert rule.check(times, elapsed_s=2.0) == "stable"

    class Measure:
        min_steps, max_steps, stability_target = 10, 200, 0.03
        time_budget_s, min_time_s = 1.0, 5.0

    capped = StopRule.from_measure(Measure())
    assert capped.min_time_s == 1.0 and capped.check(times, elapsed_s=1.0) == "stable"


# ---- the CUDA event clock, with stand-in events (this machine has no GPU) ------------------------


class FakeStreams:
    """Stands in for torch.cuda's streams and synchronize: records which device each call named."""

    def __init__(self):
        self.current_stream_devices, self.synchronized = [], []

    def current_stream(self, device=None):
        self.current_stream_devices.append(device)
        return ("stream", device)

    def synchronize(self, device=None):
        self.synchronized.append(device)


class FakeGpu:
    """A device timeline: events are 'reached' once the fake GPU's progress passes them."""

    def __init__(self, step_ms):
        self.step_ms = step_ms
        self.recorded = 0
        self.reached = 0  # how many recorded events the GPU has passed
        self.queries = 0
        self.elapsed_calls = 0


class FakeEvent:
    def __init__(self, gpu):
        self.gpu, self.index, self.stream = gpu, None, None

    def record(self, stream=None):
        self.stream = stream
        self.index = self.gpu.recorded
        self.gpu.recorded += 1

    def query(self):
        self.gpu.queries += 1
        return self.index < self.gpu.reached

    def elapsed_time(self, end):
        self.gpu.elapsed_calls += 1
        assert self.index < self.gpu.reached and end.index < self.gpu.reached, "not reached"
        return self.gpu.step_ms * (end.index - self.index)


def _fake_cuda_clock(monkeypatch, device, step_ms=10.0):
    from gpuopt.trial.measure import CudaEventClock

    streams = FakeStreams()
    monkeypatch.setattr(torch.cuda, "current_stream", streams.current_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", streams.synchronize)
    gpu = FakeGpu(step_ms)
    clock = CudaEventClock(device, event_factory=lambda: FakeEvent(gpu))
    return clock, gpu, streams


def test_cuda_clock_records_on_its_own_devices_stream_and_syncs_that_device(monkeypatch):
    device = torch.device("cuda", 1)
    clock, gpu, streams = _fake_cuda_clock(monkeypatch, device)
    clock.start()
    for _ in range(3):
        clock.mark()
    gpu.reached = gpu.recorded  # the GPU ran everything queued
    times, _ = clock.finish()
    assert times == pytest.approx([0.01, 0.01, 0.01])
    assert streams.current_stream_devices == [device] * 4  # cuda:1's stream, never cuda:0's
    assert streams.synchronized == [device, device]  # the window's two ends, cuda:1 only


def test_cuda_clock_reports_only_reached_steps_and_queries_each_event_about_once(monkeypatch):
    clock, gpu, _ = _fake_cuda_clock(monkeypatch, torch.device("cuda", 0))
    clock.start()
    steps, seen = 500, []
    for i in range(steps):
        clock.mark()
        gpu.reached = max(0, gpu.recorded - 3)  # the GPU runs three steps behind the host
        if i >= 10:  # the stop rule's check after min_steps, each step (as Lightning's callback)
            seen.append(len(clock.completed_step_times()))
    # After mark i the GPU has reached the boundaries 0..i-2: i-2 completed steps, never more.
    assert seen == [i - 2 for i in range(10, steps)]
    # Cached intervals: each event is timed once and queried about once per check (plus the one
    # found not reached yet), not once per event per check (~125k queries by step 500).
    assert gpu.elapsed_calls == seen[-1]
    assert gpu.queries <= seen[-1] + len(seen) + 1
    gpu.reached = gpu.recorded
    times, _ = clock.finish()
    assert len(times) == steps and gpu.elapsed_calls == steps


def test_cuda_device_is_made_current_and_initialized_when_resolved(monkeypatch):
    from gpuopt.trial import devices

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append(("init",)))
    assert devices.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert calls == [("set_device", torch.device("cuda", 1)), ("init",)]
    calls.clear()
    assert devices.resolve_device("cuda") == torch.device("cuda", 0)
    assert calls == [("set_device", torch.device("cuda", 0)), ("init",)]
    calls.clear()
    assert devices.resolve_device("cpu") == torch.device("cpu") and calls == []


# -- FLOPs with activation checkpointing, steady state ---------------------------------------------
@pytest.mark.parametrize("checkpointed", [False, True])
def test_step_flops_count_recompute_apart_from_the_model_flops(checkpointed):
    import torch

    from gpuopt.trial.measure import measure_step_flops
    from gpuopt.workload.models import MLP

    model = MLP(12, 10, 16, 2, activation_checkpointing=checkpointed)
    flops = measure_step_flops(lambda: model(torch.randn(4, 12)).sum().backward())
    # Linear 12->16, two 16->16 blocks, 16->10; 4 samples. Forward 2*sum(in*out) per sample, the
    # backward the same for weight gradients plus input gradients for all but the first layer.
    layers = [(12, 16), (16, 16), (16, 16), (16, 10)]
    forward = 4 * 2 * sum(i * o for i, o in layers)
    model_flops = 3 * forward - 4 * 2 * 12 * 16
    assert flops.model == model_flops
    # Checkpointing recomputes each block's forward in the backward: hardware FLOPs only.
    recompute = 4 * 2 * 2 * 16 * 16 if checkpointed else 0
    assert flops.recompute == recompute and flops.hardware == model_flops + recompute


def test_epoch_overhead_is_the_first_fetch_beyond_a_steady_one():
    from gpuopt.trial.measure import epoch_overhead

    assert epoch_overhead(0.30, 0.02) == pytest.approx(0.28)
    assert epoch_overhead(0.01, 0.02) == 0.0  # a boundary never makes a run faster


def test_amortized_throughput_spreads_the_boundary_over_the_real_epoch():
    from gpuopt.trial.measure import amortized_throughput

    # 100 steps of 10 ms (100 samples/s at batch 1... any batch: the ratio is what counts) plus a
    # 1 s boundary: the epoch takes 2 s instead of 1 s.
    assert amortized_throughput(1000.0, 0.01, 100, 1.0) == pytest.approx(500.0)
    # A long epoch hides the same boundary.
    assert amortized_throughput(1000.0, 0.01, 100_000, 1.0) == pytest.approx(999.0, rel=1e-4)
    # No epochs (an endless stream) or no measured overhead: the steady state.
    assert amortized_throughput(1000.0, 0.01, None, 1.0) == 1000.0
    assert amortized_throughput(1000.0, 0.01, 100, None) == 1000.0


# ---- the step's loss watch: a non-finite loss at any step is caught at the window's end ----------


def _workload(compose_cfg, losses):
    """gpuopt's standard step on a real (tiny) model, over 4 ready batches; its loss at step i is
    the cross-entropy plus `losses(i)`, a constant: it sets the loss's value, not its gradient, so a
    NaN step leaves the parameters finite and the next losses finite (a tensor also sets the
    loss's dtype)."""
    from gpuopt.engines._batches import BatchFeed
    from gpuopt.engines._step import build_workload
    from gpuopt.trial import policies
    from gpuopt.trial.prepare import load_spec
    from tests.conftest import TINY_TRIAL

    spec = load_spec(compose_cfg(*TINY_TRIAL, "device=cpu", "optimizer=sgd"))
    cpu = torch.device("cpu")
    precision = policies.precision_policy(spec.precision, cpu)
    workload = build_workload(spec, torch.nn.Linear(6, 3), cpu, precision, non_blocking=False)
    calls = itertools.count()

    def loss(outputs, targets):
        extra = losses(next(calls))
        total = torch.nn.functional.cross_entropy(outputs, targets) + extra
        return total.to(extra.dtype) if isinstance(extra, torch.Tensor) else total

    workload.loss = loss
    generator = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(4, 6, generator=generator), torch.tensor([0, 1, 2, 0])) for _ in range(4)
    ]
    return workload, BatchFeed(batches, workload.to_device, cpu)


def _window(workload, feed, steps):
    rule = StopRule(min_steps=5, max_steps=steps, time_budget_s=math.inf, stability_target=0.0)
    return run_window(lambda i: workload.train_step(feed.next_step()), HostClock(), rule)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_at_one_step_inside_the_window_is_reported_at_its_end(compose_cfg, bad):
    from gpuopt.trial.failures import Diverged

    workload, feed = _workload(compose_cfg, lambda i: bad if i == 7 else 0.0)
    result = _window(workload, feed, steps=40)
    assert result.steps == 40  # the window ran on: no host read of the loss inside it
    assert all(torch.isfinite(p).all() for p in workload.model.parameters())
    assert torch.isfinite(workload.train_step(feed.next_step()))  # later losses are finite again
    with pytest.raises(Diverged, match="during the timed window"):
        workload.check_finite("the timed window")


def test_finite_losses_are_not_diverged_even_where_a_half_precision_sum_would_overflow(
    compose_cfg,
):
    # Losses of 60,000 in fp16 (its largest finite value is 65,504): 40 of them sum past it.
    workload, feed = _workload(compose_cfg, lambda i: torch.tensor(6e4, dtype=torch.float16))
    _window(workload, feed, steps=40)
    workload.check_finite("the timed window")  # no Diverged
    assert workload.loss_sum is not None and workload.loss_sum.dtype == torch.float32
    assert workload.loss_sum.item() == 0.0  # each check starts the next span's sum afresh
    workload.check_finite("the compute-ceiling replay")  # nothing new: still finite
