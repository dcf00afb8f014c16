"""The NVML sampler with a scripted NVML stand-in (this machine has no NVIDIA GPU), its statistics,
the device-handle mapping, and the null results when NVML is absent."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from gpuopt.core.result import Metrics
from gpuopt.engines._window import apply_device_monitor
from gpuopt.trial import monitor
from gpuopt.trial.monitor import NvmlSampler, Sample, integrate_power, summarize


class NotSupported(Exception):
    """Stands in for pynvml.NVMLError_NotSupported."""


class ScriptedNvml:
    """Answers NVML queries from scripts; a field scripted as None raises NotSupported."""

    def __init__(self, utilization=(50,), power_mw=(100_000,), memory_mb=(1000,), energy_mj=None):
        self.utilization, self.power_mw, self.memory_mb = (
            list(utilization),
            list(power_mw),
            list(memory_mb),
        )
        self.energy_mj = list(energy_mj) if energy_mj is not None else None
        self.calls = 0

    @staticmethod
    def _next(script):
        if script is None:
            raise NotSupported()
        return script.pop(0) if len(script) > 1 else script[0]

    def nvmlDeviceGetUtilizationRates(self, handle):
        assert handle == "handle-0"
        self.calls += 1
        return SimpleNamespace(gpu=self._next(self.utilization), memory=0)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._next(self.power_mw)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self._next(self.memory_mb) * 2**20)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._next(self.energy_mj)


def test_summary_of_samples():
    samples = [
        Sample(0.0, 20.0, 100.0, 100.0),
        Sample(1.0, 60.0, 300.0, 200.0),
        Sample(3.0, 100.0, 200.0, 300.0),
    ]
    stats = summarize(samples, energy_counter_j=None)
    assert (stats.samples, stats.utilization, stats.memory_used_mb, stats.power_w) == (
        3,
        60.0,
        300.0,
        200.0,
    )
    assert stats.energy_j == pytest.approx(1.0 * 150 + 2.0 * 250)  # trapezoids
    assert stats.energy_source == "integrated power"
    counted = summarize(samples, energy_counter_j=42.0)
    assert (counted.energy_j, counted.energy_source) == (42.0, "counter")


def test_summary_skips_unsupported_fields():
    samples = [Sample(0.0, None, None, None), Sample(1.0, 30.0, None, None)]
    stats = summarize(samples, energy_counter_j=None)
    assert stats.utilization == 30.0
    assert stats.power_w is None and stats.memory_used_mb is None and stats.energy_j is None
    assert integrate_power([Sample(0.0, 1.0, 1.0, 5.0)]) is None


def test_sampler_thread_collects_during_the_window_with_integrated_energy():
    nvml = ScriptedNvml(utilization=[10, 90, 90, 90], power_mw=[250_000], energy_mj=None)
    sampler = NvmlSampler(nvml, "handle-0", interval_s=0.01)
    sampler.start()
    time.sleep(0.15)
    stats = sampler.stop()
    assert stats.samples == len(sampler.samples) >= 3
    expected_util = (10 + 90 * (stats.samples - 1)) / stats.samples
    assert stats.utilization == pytest.approx(expected_util)
    assert stats.power_w == 250.0 and stats.memory_used_mb == 1000.0
    span = sampler.samples[-1].t - sampler.samples[0].t
    assert stats.energy_source == "integrated power"
    assert stats.energy_j == pytest.approx(250.0 * span)
    calls = nvml.calls
    time.sleep(0.05)
    assert nvml.calls == calls  # the thread stopped with the window


def test_sampler_prefers_the_energy_counter():
    nvml = ScriptedNvml(energy_mj=[1_000_000, 1_004_500])  # mJ at start, at stop
    sampler = NvmlSampler(nvml, "handle-0", interval_s=0.01)
    sampler.start()
    stats = sampler.stop()
    assert (stats.energy_j, stats.energy_source) == (4.5, "counter")


def test_nvml_handle_by_uuid_then_pci_bus_id(monkeypatch):
    props = SimpleNamespace(uuid="1234abcd", pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)

    class ByUuid:
        def nvmlDeviceGetHandleByUUID(self, uuid):
            if uuid != "GPU-1234abcd":
                raise NotSupported(uuid)
            return "by-uuid"

    class ByBus:
        def nvmlDeviceGetHandleByUUID(self, uuid):
            raise NotSupported(uuid)

        def nvmlDeviceGetHandleByPciBusId(self, bus):
            return f"bus {bus}"

    device = torch.device("cuda", 0)
    assert monitor.nvml_handle(ByUuid(), device) == "by-uuid"
    assert monitor.nvml_handle(ByBus(), device) == "bus 00000000:3b:00.0"


def test_nvml_absent_gives_a_note_and_null_metrics(monkeypatch):
    def no_nvml():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(monitor, "import_nvml", no_nvml)
    sampler, note = monitor.open_sampler(torch.device("cuda", 0), 0.1)
    assert sampler is None and "NVML unavailable" in note and "null" in note
    m = Metrics(data_wait=12.0)
    apply_device_monitor(m, "cuda", None, samples=100)
    assert (m.utilization, m.power_w, m.energy_per_sample_j) == (None, None, None)


def test_no_sampler_on_cpu_and_cpu_utilization_is_compute_share():
    assert monitor.open_sampler(torch.device("cpu"), 0.1) == (None, None)
    m = Metrics(data_wait=12.5)
    apply_device_monitor(m, "cpu", None, samples=100)
    assert m.utilization == 87.5 and m.power_w is None


def test_nvml_numbers_become_metrics():
    stats = summarize(
        [Sample(0.0, 80.0, 10.0, 200.0), Sample(2.0, 60.0, 10.0, 200.0)], energy_counter_j=None
    )
    m = Metrics(data_wait=1.0)
    apply_device_monitor(m, "cuda", stats, samples=1000)
    assert (m.utilization, m.power_w) == (70.0, 200.0)
    assert m.energy_per_sample_j == pytest.approx(400.0 / 1000)


class NvmlError(Exception):
    """Stands in for pynvml.NVMLError: `value` is the NVML return code."""

    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


class SampledNvml(ScriptedNvml):
    """ScriptedNvml plus the driver's buffer of timestamped utilization samples
    (nvmlDeviceGetSamples with NVML_GPU_UTILIZATION_SAMPLES)."""

    NVML_GPU_UTILIZATION_SAMPLES = 1
    NVML_ERROR_NOT_FOUND = 6

    def __init__(self, error=None, **kwargs):
        super().__init__(**kwargs)
        self.buffer, self.last_seen_args, self.error = [], [], error

    def add(self, value, at_us=None):
        self.buffer.append((int(time.time() * 1e6) if at_us is None else at_us, value))

    def nvmlDeviceGetSamples(self, handle, kind, last_seen):
        assert handle == "handle-0" and kind == self.NVML_GPU_UTILIZATION_SAMPLES
        self.last_seen_args.append(last_seen)
        if self.error is not None:
            raise NvmlError(self.error)
        newer = [(t, v) for t, v in list(self.buffer) if t > last_seen]
        if not newer:
            raise NvmlError(self.NVML_ERROR_NOT_FOUND)
        samples = [
            SimpleNamespace(timeStamp=t, sampleValue=SimpleNamespace(uiVal=v)) for t, v in newer
        ]
        return 1, samples  # NVML_VALUE_TYPE_UNSIGNED_INT


def _run_window(sampler, nvml, value, seconds=0.12, every_s=0.01):
    sampler.start()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        time.sleep(every_s)
        nvml.add(value)  # the driver's sample of the period just ended
    return sampler.stop()


def test_utilization_from_timestamped_samples_inside_the_window_only():
    nvml = SampledNvml(utilization=[50])  # polled: 50 (its 1 s average), ignored
    now_us = int(time.time() * 1e6)
    for k in range(10, 0, -1):  # warm-up, before the window: in the driver's buffer, excluded
        nvml.add(5, at_us=now_us - k * 100_000)
    sampler = NvmlSampler(nvml, "handle-0", interval_s=0.01)
    stats = _run_window(sampler, nvml, 90)
    assert stats.utilization == 90.0 and stats.utilization_source == monitor.UTILIZATION_SAMPLED
    added = len(nvml.buffer) - 10
    assert len(sampler.device_samples) == added  # no warm-up sample, no sample twice
    # lastSeenTimeStamp: 0 once (the probe), then the newest timestamp seen, never going back.
    assert nvml.last_seen_args[0] == 0
    later = nvml.last_seen_args[1:]
    assert later[0] == now_us - 100_000 and later == sorted(later) and len(later) >= 2
    assert not any("utilization" in note for note in stats.notes)


def test_no_new_device_sample_is_not_unsupported():
    nvml = SampledNvml()  # empty buffer: NVML answers NOT_FOUND
    sampler = NvmlSampler(nvml, "handle-0", interval_s=0.01)
    stats = _run_window(sampler, nvml, 70, seconds=0.05)
    assert (stats.utilization, stats.utilization_source) == (70.0, monitor.UTILIZATION_SAMPLED)


def test_unsupported_device_samples_fall_back_to_polled_utilization_flagged():
    nvml = SampledNvml(error=3, utilization=[40])  # NVML_ERROR_NOT_SUPPORTED
    sampler = NvmlSampler(nvml, "handle-0", interval_s=0.01)
    stats = _run_window(sampler, nvml, 90, seconds=0.05)
    assert (stats.utilization, stats.utilization_source) == (40.0, monitor.UTILIZATION_POLLED)
    assert len(nvml.last_seen_args) == 1  # probed once, not polled after
    assert any(n.startswith("utilization: the device keeps no timestamped") for n in stats.notes)


def test_power_is_the_energy_counter_over_the_window_else_the_polled_mean_flagged():
    nvml = ScriptedNvml(power_mw=[100_000], energy_mj=[1_000_000, 1_004_500])
    sampler = NvmlSampler(nvml, "handle-0", interval_s=0.01)
    sampler.start()
    time.sleep(0.03)
    stats = sampler.stop()
    assert 0.03 <= sampler.window_s < 1.0
    assert stats.power_w == pytest.approx(4.5 / sampler.window_s)  # not the polled 100 W
    assert stats.power_source == monitor.POWER_COUNTER
    assert not any(n.startswith("power_w") for n in stats.notes)
    no_counter = summarize([Sample(0.0, 1.0, 1.0, 150.0), Sample(1.0, 1.0, 1.0, 250.0)], None, 1.0)
    assert (no_counter.power_w, no_counter.power_source) == (200.0, monitor.POWER_POLLED)
    assert any(n.startswith("power_w: no NVML energy counter") for n in no_counter.notes)
