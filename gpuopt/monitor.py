"""NVML sampling during the timed window: GPU utilization, memory, power and energy.

A background thread polls NVML every `interval_s` while the window runs (NVML calls are cheap
driver queries, no CUDA sync). The NVML module is injectable, so tests can drive the sampler with a
scripted stand-in; the real path imports pynvml (nvidia-ml-py) and maps the torch device to its NVML
handle by UUID (or PCI bus id), which stays right under CUDA_VISIBLE_DEVICES, where torch's index
and NVML's index differ.
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
    power_w: float | None  # mean
    energy_j: float | None  # from the energy counter when supported, else integrated power
    energy_source: str | None  # "counter" | "integrated power" | None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def integrate_power(samples: list[Sample]) -> float | None:
    """Trapezoidal integral of power over the samples' timestamps, in joules."""
    points = [(s.t, s.power_w) for s in samples if s.power_w is not None]
    if len(points) < 2:
        return None
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in itertools.pairwise(points))


def summarize(samples: list[Sample], energy_counter_j: float | None) -> NvmlStats:
    """Statistics over a window's samples. `energy_counter_j`: the energy counter's difference
    over the window, when the device supports it (Volta and newer)."""
    utilization = _mean([s.utilization for s in samples if s.utilization is not None])
    memory = [s.memory_used_mb for s in samples if s.memory_used_mb is not None]
    power = _mean([s.power_w for s in samples if s.power_w is not None])
    if energy_counter_j is not None:
        energy, source = energy_counter_j, "counter"
    else:
        energy = integrate_power(samples)
        source = "integrated power" if energy is not None else None
    return NvmlStats(
        len(samples), utilization, max(memory) if memory else None, power, energy, source
    )


class NvmlSampler:
    """Polls one device in a background thread between start() and stop()."""

    def __init__(self, nvml: Any, handle: Any, interval_s: float = 0.1) -> None:
        self.nvml = nvml
        self.handle = handle
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._energy_start_mj: float | None = None

    def _query(self, fn_name: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, fn_name)(self.handle, *args)
        except Exception:  # NVMLError_NotSupported and friends: this field is unavailable
            return None

    def sample_once(self) -> Sample:
        rates = self._query("nvmlDeviceGetUtilizationRates")
        memory = self._query("nvmlDeviceGetMemoryInfo")
        power_mw = self._query("nvmlDeviceGetPowerUsage")
        return Sample(
            t=time.perf_counter(),
            utilization=float(rates.gpu) if rates is not None else None,
            memory_used_mb=memory.used / 2**20 if memory is not None else None,
            power_w=power_mw / 1e3 if power_mw is not None else None,
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample_once())
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self.samples = []
        self._stop.clear()
        self._energy_start_mj = self._query("nvmlDeviceGetTotalEnergyConsumption")
        self._thread = threading.Thread(target=self._run, name="gpuopt-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> NvmlStats:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append(self.sample_once())  # one sample at the window's end
        energy_end_mj = self._query("nvmlDeviceGetTotalEnergyConsumption")
        counter_j = None
        if self._energy_start_mj is not None and energy_end_mj is not None:
            counter_j = (energy_end_mj - self._energy_start_mj) / 1e3
        return summarize(self.samples, counter_j)


def import_nvml() -> ModuleType:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml


def nvml_handle(nvml: Any, device: torch.device) -> Any:
    """The NVML handle of a torch CUDA device: by UUID, else by PCI bus id (both global ids,
    unlike indices, which CUDA_VISIBLE_DEVICES renumbers)."""
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


def open_sampler(
    device: torch.device, interval_s: float, nvml: Any = None
) -> tuple[NvmlSampler | None, str | None]:
    """A sampler for `device`, or (None, why not). Only NVIDIA CUDA devices have NVML."""
    global _said_absent
    if device.type != "cuda":
        return None, None
    try:
        nvml = nvml if nvml is not None else import_nvml()
        handle = nvml_handle(nvml, device)
    except Exception as exc:
        note = (
            f"NVML unavailable ({type(exc).__name__}: {exc}): utilization, power_w and "
            "energy_per_sample_j are null"
        )
        if not _said_absent:
            log.warning(note)
            _said_absent = True
        return None, note
    return NvmlSampler(nvml, handle, interval_s), None
