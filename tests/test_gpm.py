"""GPM (NVML GPU Performance Monitoring, Hopper and newer) over the timed window, driven by a
scripted NVML with GPM (this machine has no NVIDIA GPU): the window's samples, its alignment, each
reason the metrics are null, and a distributed job's merge of them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from gpuopt.core.metrics import METRICS
from gpuopt.core.result import Metrics, Status, TrialResult
from gpuopt.engines._window import WindowMonitors, apply_device_monitor
from gpuopt.trial import gpm, monitor
from gpuopt.trial.gpm import GpmSampler, open_gpm, spaced
from gpuopt.trial.ranks import merge_ranks
from tests.test_monitor import NvmlError, ScriptedNvml

GPM_NAMES = [m.name for m in METRICS if m.gpm]


class ScriptedGpm(ScriptedNvml):
    """ScriptedNvml plus GPM as pynvml (nvidia-ml-py 13) has it: a sample buffer snapshots each
    metric's cumulative counter (its scripted `level`, in %, integrated over time), and
    nvmlGpmMetricsGet gives each metric's mean level between sample1 (the earlier) and sample2.
    `supported` 0 is a GPU without GPM; `sample_error`: the NVML code nvmlGpmSampleGet raises;
    `metric_errors`: metric id -> the nvmlReturn nvmlGpmMetricsGet gives it; `mig`: the handle is
    a MIG instance's (GPU instance 3 of "parent"). `clock`: the time the counters integrate over
    (the host's by default; a test sets a scripted one where a timing must not matter)."""

    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_GPM_METRIC_SM_UTIL = 2
    NVML_GPM_METRIC_SM_OCCUPANCY = 3
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
    NVML_GPM_METRIC_DRAM_BW_UTIL = 10

    def __init__(self, level=None, supported=1, sample_error=None, metric_errors=None, mig=False):
        super().__init__()
        self.level = dict(level or {2: 40.0, 3: 25.0, 5: 10.0, 10: 30.0})
        self.counters = dict.fromkeys(self.level, 0.0)
        self.clock = time.perf_counter
        self._at = self.clock()
        self.supported, self.sample_error, self.mig = supported, sample_error, mig
        self.metric_errors = dict(metric_errors or {})
        self.allocated, self.freed, self.reads, self.gets = 0, 0, [], 0

    def set_level(self, **by_id):
        self._advance()
        self.level.update({int(k.lstrip("m")): v for k, v in by_id.items()})

    def _advance(self):
        now = self.clock()
        for metric_id, level in self.level.items():
            self.counters[metric_id] = self.counters.get(metric_id, 0.0) + level * (now - self._at)
        self._at = now

    # -- GPM, as pynvml has it
    class c_nvmlGpmMetricsGet_t:  # pynvml's name
        def __init__(self):
            self.version = self.numMetrics = 0
            self.sample1 = self.sample2 = None
            self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)]

    def nvmlDeviceIsMigDeviceHandle(self, handle):
        return self.mig

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle):
        assert self.mig and handle == "handle-0"
        return "parent"

    def nvmlDeviceGetGpuInstanceId(self, handle):
        return 3

    def nvmlGpmQueryDeviceSupport(self, device):
        assert device == ("parent" if self.mig else "handle-0")
        return SimpleNamespace(version=1, isSupportedDevice=self.supported)

    def nvmlGpmSampleAlloc(self):
        self.allocated += 1
        return SimpleNamespace(counters=None, at=None, freed=False)

    def nvmlGpmSampleFree(self, sample):
        assert not sample.freed
        sample.freed = True
        self.freed += 1

    def _read(self, sample):
        if self.sample_error is not None:
            raise NvmlError(self.sample_error)
        self._advance()
        sample.counters, sample.at = dict(self.counters), self._at
        self.reads.append(self._at)
        return sample

    def nvmlGpmSampleGet(self, device, sample):
        assert not self.mig and device == "handle-0"
        return self._read(sample)

    def nvmlGpmMigSampleGet(self, device, instance, sample):
        assert self.mig and (device, instance) == ("parent", 3)
        return self._read(sample)

    def nvmlGpmMetricsGet(self, request):
        assert request.version == self.NVML_GPM_METRICS_GET_VERSION
        first, second = request.sample1, request.sample2
        assert first.at < second.at and not first.freed and not second.freed  # sample1: earlier
        self.gets += 1
        for metric in request.metrics[: request.numMetrics]:
            error = self.metric_errors.get(metric.metricId)
            if error is not None:
                metric.nvmlReturn, metric.value = error, 0.0
                continue
            spent = second.counters[metric.metricId] - first.counters[metric.metricId]
            metric.nvmlReturn, metric.value = 0, spent / (second.at - first.at)
        return request


def _window(nvml, seconds=0.3, interval_s=1.0, during=None):
    sampler, why = open_gpm(nvml, "handle-0", interval_s=interval_s)
    assert why is None, why
    sampler.start()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if during is not None:
            during(deadline - time.perf_counter())
        time.sleep(0.01)
    return sampler, sampler.stop()


def test_the_catalogue_names_the_four_gpm_metrics_with_their_nvml_ids():
    assert gpm.gpm_fields() == (
        ("sm_active", "SM_UTIL"),
        ("sm_occupancy", "SM_OCCUPANCY"),
        ("tensor_active", "ANY_TENSOR_UTIL"),
        ("dram_bw_util", "DRAM_BW_UTIL"),
    )
    import pynvml

    for _, suffix in gpm.gpm_fields():  # the real module has each id
        assert isinstance(getattr(pynvml, f"NVML_GPM_METRIC_{suffix}"), int)
    assert hasattr(pynvml, "c_nvmlGpmMetricsGet_t") and hasattr(pynvml, "nvmlGpmMigSampleGet")


def test_a_window_reads_the_four_metrics_between_its_own_ends_only():
    now = [0.0]  # the GPU's counters integrate over this scripted time, not the host's
    nvml = ScriptedGpm(level={2: 5.0, 3: 5.0, 5: 5.0, 10: 5.0})
    nvml.clock = lambda: now[0]
    now[0] = 0.05  # warm-up: 5% before the window, counted in the counters
    sampler, why = open_gpm(nvml, "handle-0")
    assert why is None
    nvml.set_level(m2=40.0, m3=25.0, m5=10.0, m10=30.0)
    sampler.start()
    time.sleep(0.2)  # the host's window: longer than GPM's refresh (no note)
    now[0] = 0.25
    nvml.set_level(m2=90.0, m3=90.0, m5=90.0, m10=90.0)  # from the window's end: must not count
    stats = sampler.stop()
    now[0] = 0.5
    assert stats.samples == 2 and stats.notes == ()
    assert stats.values == pytest.approx(
        {"sm_active": 40.0, "sm_occupancy": 25.0, "tensor_active": 10.0, "dram_bw_util": 30.0},
        rel=0.05,
    )


def test_a_long_window_takes_intermediate_samples_weighted_by_their_seconds():
    nvml = ScriptedGpm(level={2: 20.0, 3: 20.0, 5: 20.0, 10: 20.0})
    switched = []

    def halfway(left_s):
        if left_s < 0.25 and not switched:
            nvml.set_level(m2=60.0)
            switched.append(True)

    _, stats = _window(nvml, seconds=0.5, interval_s=0.12, during=halfway)
    assert stats.samples >= 4 and nvml.gets >= 3
    assert stats.values["sm_active"] == pytest.approx(40.0, abs=4.0)  # half at 20, half at 60
    assert stats.values["dram_bw_util"] == pytest.approx(20.0, rel=0.05)
    assert nvml.allocated == nvml.freed  # every sample buffer freed (the probe's too)


def test_segments_shorter_than_gpms_refresh_are_merged_into_the_last():
    def at(*times):
        return [t.t for t in spaced([SimpleNamespace(t=t) for t in times], 0.1)]

    assert at(0.0, 0.05, 0.15, 0.3, 0.35) == [0.0, 0.15, 0.35]
    assert at(0.0, 0.02) == [0.0, 0.02]  # a window shorter than 100 ms keeps both ends
    assert at(0.0, 1.0, 2.0, 3.0) == [0.0, 1.0, 2.0, 3.0]


def test_a_mig_instance_is_sampled_through_its_parent_gpu():
    nvml = ScriptedGpm(mig=True)
    _, stats = _window(nvml, seconds=0.15)
    assert stats.values["sm_active"] == pytest.approx(40.0, rel=0.05)


@pytest.mark.parametrize(
    ("nvml", "says"),
    [
        (ScriptedGpm(supported=0), "GPM is not supported on this GPU (Hopper and newer have it)"),
        (ScriptedGpm(supported=0, mig=True), "GPM is not supported for this MIG instance"),
        (ScriptedGpm(sample_error=4), "no permission to read GPM counters"),
        (ScriptedNvml(), "this nvidia-ml-py has no GPM API"),
    ],
    ids=["pre-hopper", "mig-without-gpm", "no-permission", "no-gpm-api"],
)
def test_where_gpm_is_not_there_one_line_says_why_and_nothing_raises(nvml, says):
    sampler, why = open_gpm(nvml, "handle-0")
    assert sampler is None and why.startswith(says) and "\n" not in why
    assert why.endswith(gpm.NULL_NOTE) and all(name in why for name in GPM_NAMES)
    assert getattr(nvml, "allocated", 0) == getattr(nvml, "freed", 0)


def test_a_metric_nvml_does_not_give_is_null_with_its_code_the_others_stay():
    nvml = ScriptedGpm(metric_errors={5: 3})  # tensor activity: NOT_SUPPORTED
    _, stats = _window(nvml, seconds=0.15)
    assert stats.values["tensor_active"] is None and stats.values["sm_active"] is not None
    assert stats.notes == ("GPM: tensor_active null (NVML returned [3])",)


def test_samples_refused_mid_window_leave_null_metrics_and_a_reason():
    nvml = ScriptedGpm()
    sampler, _ = open_gpm(nvml, "handle-0")
    sampler.start()
    nvml.sample_error = 4  # a profiler took the counters during the window
    stats = sampler.stop()
    assert all(v is None for v in stats.values.values())
    (note,) = stats.notes
    assert note.startswith("GPM unavailable (nvmlGpmSampleGet: NvmlError") and gpm.NULL_NOTE in note


def _monitors(monkeypatch, nvml, notes):
    def open_sampler(device, interval_s, nvml_module=None):
        return monitor.NvmlSampler(nvml, "handle-0", interval_s), None

    monkeypatch.setattr(monitor, "open_sampler", open_sampler)
    return WindowMonitors(torch.device("cuda", 0), 0.02, notes)


def test_a_trial_window_records_the_four_metrics_beside_util_gpu(monkeypatch):
    nvml = ScriptedGpm(level={2: 12.0, 3: 8.0, 5: 0.0, 10: 3.0})
    nvml.utilization = [100]  # util.gpu: a kernel always running
    notes: list[str] = []
    monitors = _monitors(monkeypatch, nvml, notes)
    monitors.start()
    time.sleep(0.15)
    stats = monitors.stop()
    m = Metrics(data_wait=0.0)
    apply_device_monitor(m, "cuda", stats, samples=100)
    assert m.utilization == 100.0 and stats.gpm.samples == 2
    assert (m.sm_active, m.sm_occupancy, m.dram_bw_util) == pytest.approx((12.0, 8.0, 3.0), 0.05)
    assert m.tensor_active == pytest.approx(0.0, abs=1e-9)
    assert not [n for n in notes if "GPM" in n]
    assert monitors.stop() is None  # a second stop (a failure's clean-up) does nothing


def test_a_gpu_without_gpm_records_null_with_the_reason_in_the_trials_warnings(monkeypatch):
    notes: list[str] = []
    monitors = _monitors(monkeypatch, ScriptedGpm(supported=0), notes)
    monitors.start()
    stats = monitors.stop()
    m = Metrics()
    apply_device_monitor(m, "cuda", stats, samples=10)
    assert m.utilization == 50.0 and all(getattr(m, n) is None for n in GPM_NAMES)
    assert [n for n in notes if "GPM" in n] == [
        f"GPM is not supported on this GPU (Hopper and newer have it): {gpm.NULL_NOTE}"
    ]


def test_cpu_and_absent_nvml_leave_the_gpm_metrics_null(monkeypatch):
    notes: list[str] = []
    cpu = WindowMonitors(torch.device("cpu"), 0.02, notes)
    cpu.start()
    m = Metrics(data_wait=10.0)
    apply_device_monitor(m, "cpu", cpu.stop(), samples=10)
    assert notes == [] and all(getattr(m, n) is None for n in GPM_NAMES)

    def no_nvml():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(monitor, "import_nvml", no_nvml)
    _, note = monitor.open_sampler(torch.device("cuda", 0), 0.1)
    assert "GPM metrics are null" in note


def test_ranks_merge_the_gpm_metrics_as_their_mean():
    def rank(sm: float | None) -> TrialResult:
        metrics = Metrics(throughput=10.0, timed_seconds=1.0, step_time_ms=1.0, timed_steps=10)
        metrics.sm_active, metrics.tensor_active = sm, 20.0
        return TrialResult(Status.OK, metrics=metrics, env={"rank": 0})

    merged = merge_ranks({0: rank(30.0), 1: rank(50.0)}, {}, "nccl", 1.0)
    assert (merged.metrics.sm_active, merged.metrics.tensor_active) == (40.0, 20.0)
    assert [row["sm_active"] for row in merged.ranks] == [30.0, 50.0]
    partial = merge_ranks({0: rank(30.0), 1: rank(None)}, {}, "nccl", 1.0)
    assert partial.metrics.sm_active is None  # none unless every rank has one


def test_gpm_sampler_never_leaks_buffers_when_the_window_fails_early():
    nvml = ScriptedGpm()
    sampler = GpmSampler(nvml, lambda b: nvml.nvmlGpmSampleGet("handle-0", b))
    sampler.start()
    sampler.stop()
    assert nvml.allocated == nvml.freed == 2
