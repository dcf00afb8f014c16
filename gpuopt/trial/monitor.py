"""NVML sampling during the timed window: GPU utilization, memory, power and energy.

A background thread (`PeriodicSampler`, GPM's too) polls NVML every `interval_s` (cheap driver
queries, no CUDA sync). The NVML module is injectable (tests script a stand-in); the device maps
to its NVML handle by UUID or PCI bus id, which stay right under CUDA_VISIBLE_DEVICES, where
torch's and NVML's indices differ.

Windows are short (0.5-2 s) next to NVML's own averaging (nvmlDeviceGetPowerUsage is a 1 s
average on Ampere and newer, nvmlDeviceGetUtilizationRates 1/6-1 s), so a polled mean mostly
describes warm-up. Hence, where the device supports them, power is the energy counter's
difference over the window, and utilization the mean of the driver's timestamped samples
(nvmlDeviceGetSamples) inside the window; else the polled means, flagged in `notes`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_said_absent = False
_said_notes: set[str] = set()

NVML_GPU_UTILIZATION_SAMPLES = 1
NVML_ERROR_NOT_FOUND = 6  # nvmlDeviceGetSamples: no sample newer than lastSeenTimeStamp
# nvmlValueType_t -> the nvmlValue_t union member that holds the sample
_VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

UTILIZATION_SAMPLED = "device samples"
UTILIZATION_POLLED = "polled"
POWER_COUNTER = "energy counter"
POWER_POLLED = "polled mean"


@dataclass(frozen=True)
class Sample:
    t: float  # time.perf_counter()
    utilization: float | None  # % of the interval in which a kernel was running
    memory_used_mb: float | None
    power_w: float | None


@dataclass(frozen=True)
class NvmlStats:
    samples: int
    utilization: float | None  # mean %
    memory_used_mb: float | None  # max
    power_w: float | None  # energy counter / window seconds, else mean of polled samples
    energy_j: float | None  # from the energy counter when supported, else integrated power
    energy_source: str | None  # "counter" | "integrated power" | None
    utilization_source: str | None = None  # UTILIZATION_SAMPLED | UTILIZATION_POLLED | None
    power_source: str | None = None  # POWER_COUNTER | POWER_POLLED | None
    notes: tuple[str, ...] = ()  # why a number fell back to NVML's coarser averages
    gpm: Any = None  # the window's GPM metrics (gpuopt.trial.gpm.GpmStats), None without GPM


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def integrate_power(samples: list[Sample]) -> float | None:
    """Trapezoidal integral of power over the samples' timestamps, in joules."""
    points = [(s.t, s.power_w) for s in samples if s.power_w is not None]
    if len(points) < 2:
        return None
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in itertools.pairwise(points))


def summarize(
    samples: list[Sample],
    energy_counter_j: float | None,
    window_s: float | None = None,
    device_utilization: list[float] | None = None,
) -> NvmlStats:
    """Statistics over a window's samples. `energy_counter_j`: the energy counter's difference
    over the window (Volta and newer); `device_utilization`: the driver's timestamped samples
    inside the window (None: the device keeps none)."""
    memory = [s.memory_used_mb for s in samples if s.memory_used_mb is not None]
    notes: list[str] = []
    if device_utilization:
        utilization, util_source = _mean(device_utilization), UTILIZATION_SAMPLED
    else:
        utilization = _mean([s.utilization for s in samples if s.utilization is not None])
        util_source = UTILIZATION_POLLED if utilization is not None else None
        if utilization is not None:
            why = (
                "the device keeps no timestamped samples"
                if device_utilization is None
                else "no timestamped sample fell inside the window"
            )
            notes.append(
                f"utilization: {why} (nvmlDeviceGetSamples); polled "
                "nvmlDeviceGetUtilizationRates, which averages over up to 1 s, partly before "
                "the window"
            )
    if energy_counter_j is not None:
        energy, source = energy_counter_j, "counter"
    else:
        energy = integrate_power(samples)
        source = "integrated power" if energy is not None else None
    if energy_counter_j is not None and window_s:
        power, power_source = energy_counter_j / window_s, POWER_COUNTER
    else:
        power = _mean([s.power_w for s in samples if s.power_w is not None])
        power_source = POWER_POLLED if power is not None else None
        if power is not None:
            notes.append(
                "power_w: no NVML energy counter; mean of polled nvmlDeviceGetPowerUsage "
                "(a 1 s average on Ampere and newer: short windows read warm-up power)"
            )
    return NvmlStats(
        len(samples),
        utilization,
        max(memory) if memory else None,
        power,
        energy,
        source,
        util_source,
        power_source,
        tuple(notes),
    )


class PeriodicSampler:
    """Calls `sample()` at start, every `interval_s` in a daemon thread, and at the end: the one
    polling loop of the NVML and GPM samplers."""

    interval_s: float
    thread_name: str

    def sample(self) -> Any:
        raise NotImplementedError

    def _start_sampling(self) -> None:
        self.sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _stop_sampling(self) -> None:
        self._stop.set()
        self._thread.join()  # before the samples are read: the thread appends to them
        self.sample()  # the window's end


class NvmlSampler(PeriodicSampler):
    """Polls one device between start() and stop(), fetching the driver's utilization samples
    newer than the last seen, and reads the energy counter at both ends."""

    thread_name = "gpuopt-nvml"

    def __init__(self, nvml: Any, handle: Any, interval_s: float = 0.1) -> None:
        self.nvml = nvml
        self.handle = handle
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self.device_samples: list[tuple[int, float]] = []  # (timestamp µs, utilization %)
        self._device_samples_supported = False
        self._last_seen_us = 0
        self._energy_start_mj: float | None = None
        self._started_s = 0.0  # perf_counter at the window's start
        self.window_s = 0.0  # the last window's seconds (energy counter read at both ends)
        self._window_us = (0, 0)  # time.time() µs at start and stop (NVML's sample clock)

    def _query(self, fn_name: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, fn_name)(self.handle, *args)
        except Exception:  # NVMLError_NotSupported and friends: this field is unavailable
            return None

    def sample(self) -> None:
        rates = self._query("nvmlDeviceGetUtilizationRates")
        memory = self._query("nvmlDeviceGetMemoryInfo")
        power_mw = self._query("nvmlDeviceGetPowerUsage")
        self.samples.append(
            Sample(
                t=time.perf_counter(),
                utilization=float(rates.gpu) if rates is not None else None,
                memory_used_mb=memory.used / 2**20 if memory is not None else None,
                power_w=power_mw / 1e3 if power_mw is not None else None,
            )
        )
        if self._device_samples_supported:
            self.fetch_device_samples()

    def fetch_device_samples(self) -> bool:
        """Append the driver's utilization samples newer than the last one seen. False when the
        device does not keep them (any NVML error but NOT_FOUND, which means: none newer)."""
        try:
            value_type, samples = self.nvml.nvmlDeviceGetSamples(
                self.handle, NVML_GPU_UTILIZATION_SAMPLES, self._last_seen_us
            )
        except Exception as exc:
            return getattr(exc, "value", None) == NVML_ERROR_NOT_FOUND
        field = _VALUE_FIELDS[value_type] if 0 <= value_type < len(_VALUE_FIELDS) else "uiVal"
        for sample in samples:
            if sample.timeStamp > self._last_seen_us:
                value = float(getattr(sample.sampleValue, field))
                self.device_samples.append((int(sample.timeStamp), value))
                self._last_seen_us = int(sample.timeStamp)
        return True

    def start(self) -> None:
        self.samples, self.device_samples = [], []
        # lastSeenTimeStamp 0 returns the driver's whole buffer: a cheap probe for support.
        self._last_seen_us = 0
        self._device_samples_supported = self.fetch_device_samples()
        self.device_samples = []
        self._energy_start_mj = self._query("nvmlDeviceGetTotalEnergyConsumption")
        self._started_s = time.perf_counter()
        self._window_us = (int(time.time() * 1e6), 0)
        self._start_sampling()

    def stop(self) -> NvmlStats:
        energy_end_mj = self._query("nvmlDeviceGetTotalEnergyConsumption")
        self.window_s = window_s = time.perf_counter() - self._started_s
        self._window_us = (self._window_us[0], int(time.time() * 1e6))
        self._stop_sampling()
        counter_j = None
        if self._energy_start_mj is not None and energy_end_mj is not None:
            counter_j = (energy_end_mj - self._energy_start_mj) / 1e3
        inside = None
        if self._device_samples_supported:
            start_us, end_us = self._window_us
            inside = [v for t, v in self.device_samples if start_us < t <= end_us]
        stats = summarize(self.samples, counter_j, window_s, inside)
        for note in stats.notes:
            if note not in _said_notes:  # once per process: every trial would say the same
                log.info(note)
                _said_notes.add(note)
        return stats


def import_nvml() -> ModuleType:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml


def nvml_handle(nvml: Any, device: torch.device) -> Any:
    """The NVML handle of a torch CUDA device: by UUID, else by PCI bus id (global ids)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        for candidate in (text, f"GPU-{text}"):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(candidate)
            except Exception:
                continue
    bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return nvml.nvmlDeviceGetHandleByPciBusId(bus)


def open_sampler(device: torch.device, interval_s: float) -> tuple[NvmlSampler | None, str | None]:
    """A sampler for `device`, or (None, why not). Only NVIDIA CUDA devices have NVML."""
    global _said_absent
    if device.type != "cuda":
        return None, None
    try:
        nvml = import_nvml()
        handle = nvml_handle(nvml, device)
    except Exception as exc:
        note = (
            f"NVML unavailable ({type(exc).__name__}: {exc}): utilization, power_w, "
            "energy_per_sample_j and the GPM metrics are null"
        )
        if not _said_absent:
            log.warning(note)
            _said_absent = True
        return None, note
    return NvmlSampler(nvml, handle, interval_s), None
