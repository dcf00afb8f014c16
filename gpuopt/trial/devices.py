"""The devices of a trial's process: resolving the one a trial runs on (`trial_device`), what it
is (`fingerprint`, in every result so numbers from different machines never mix silently) and
what it does natively (`detect_capabilities`: the facts the knobs' poor-choice rules judge).
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gpuopt
from gpuopt.core import knobs
from gpuopt.core.checks.device import check_device_facts
from gpuopt.core.host import cpu_model, usable_cpus
from gpuopt.trial.gpm import device_support
from gpuopt.trial.monitor import import_nvml

if TYPE_CHECKING:
    import torch

    from gpuopt.core.spec import TrialSpec


def resolve_device(device_type: str) -> torch.device:
    """`auto` -> cuda if available, then mps, then cpu; anything else as given. A CUDA device is
    made current and initialized: work without an explicit device then goes to cuda:N, not
    cuda:0, and the allocator statistics exist before the first tensor does (pytorch#72404)."""
    import torch

    if device_type != "auto":
        device = torch.device(device_type)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.cuda.init()
    return device


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple {platform.machine()} GPU (MPS)"
    return cpu_model()


def nvidia_driver_version() -> str | None:
    try:
        version = import_nvml().nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        return (
            text.split("Kernel Module")[1].split()[0] if "Kernel Module" in text else text.strip()
        )
    except (OSError, IndexError):
        return None


def fingerprint(device: torch.device) -> dict[str, Any]:
    """Facts that change measured numbers: hardware, driver, software versions, host."""
    import torch

    info: dict[str, Any] = {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "driver": nvidia_driver_version() if device.type == "cuda" else None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "torch_threads": torch.get_num_threads(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpuopt": gpuopt.__version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["device_memory_mb"] = round(props.total_memory / 2**20)
    return info


def supported_modes(device: torch.device) -> list[str]:
    """The precision modes a device can run (tf32 needs compute capability >= 8.0)."""
    import torch

    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        modes = ["fp32", "tf32", "fp16"] if major >= 8 else ["fp32", "fp16"]
        return modes + (["bf16"] if torch.cuda.is_bf16_supported() else [])
    return ["fp32", "bf16", "fp16"]


def _cuda_facts(index: int) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(index)
    return {
        "device": f"cuda:{index}",
        "name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_mb": round(props.total_memory / 2**20),
    }


def list_devices() -> list[dict[str, Any]]:
    import torch

    devices = [{"device": "cpu", "name": cpu_model(), "cores": usable_cpus()}]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices += [_cuda_facts(index) for index in range(count)]
    if torch.backends.mps.is_available():
        devices.append({"device": "mps", "name": device_name(torch.device("mps"))})
    return devices


def why_no_accelerator() -> dict[str, str] | None:
    """None when an accelerator is visible; else why not and what to do."""
    import torch

    if torch.cuda.is_available() or torch.backends.mps.is_available():
        return None
    on_colab = "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ
    if on_colab:
        return {
            "why": "this Colab runtime has no GPU attached",
            "what_to_do": "Runtime -> Change runtime type -> GPU (e.g. T4), then restart",
        }
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return {
            "why": f"torch {torch.__version__} is a CPU-only build",
            "what_to_do": "install a CUDA build on a machine with an NVIDIA GPU, e.g. "
            "pip install torch --index-url https://download.pytorch.org/whl/cu126",
        }
    if nvidia_driver_version() is None and not _nvidia_smi_works():
        return {
            "why": f"torch has CUDA {torch.version.cuda}, but no NVIDIA driver was found",
            "what_to_do": "install the NVIDIA driver (nvidia-smi must work), or run on a GPU machine",
        }
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {
        "why": "an NVIDIA driver is present but CUDA sees no device"
        + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""),
        "what_to_do": "check CUDA_VISIBLE_DEVICES and nvidia-smi; the driver may be older than "
        f"torch's CUDA {torch.version.cuda} needs",
    }


def _nvidia_smi_works() -> bool:
    try:
        return (
            subprocess.run(["nvidia-smi"], capture_output=True, timeout=10, check=False).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def cpu_native(dtype: str) -> bool:
    """Whether this CPU does `bf16` | `fp16` math natively (oneDNN's check; older torch: no fp16's)."""
    import torch

    check = getattr(torch.ops.mkldnn, f"_is_mkldnn_{dtype}_supported", None)
    return bool(check()) if check is not None else False


def detect_capabilities(device: torch.device | str) -> dict[str, Any]:
    """What the device is and does natively: the facts gpuopt.core.knobs.judge reads."""
    import torch

    if isinstance(device, str):
        device = resolve_device(device)
    facts = {"device": device.type, "device_name": device_name(device), "cpus": usable_cpus()}
    if device.type == "cpu":
        facts.update(bf16_native=cpu_native("bf16"), fp16_native=cpu_native("fp16"), tf32=False)
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        facts.update(compute_capability=f"{major}.{minor}", tf32=major >= 8, bf16_native=major >= 8)
        facts["gpu_count"] = torch.cuda.device_count()
        facts["gpm"], why = device_support(device)  # SM activity etc. (Hopper and newer)
        if why:
            facts["gpm_why"] = why
    elif device.type == "mps":
        facts.update(tf32=False)
    return facts


def trial_device(spec: TrialSpec) -> tuple[torch.device, list[str]]:
    """The device a trial runs on, with the settings the knob catalogue's rules judge poor there
    (each with the rule's reason). Raises ConfigError for a device that is not here and settings
    it cannot run (the sweeper's rules, gpuopt.core.checks.device, against this process's facts)."""
    check_device_facts(spec, _device_facts(spec))
    device = resolve_device(spec.device.type)
    facts = detect_capabilities(device)
    values = {k.key: knobs.canonical(attrgetter(k.key)(spec)) for k in knobs.KNOBS if k.poor}
    judged = [(key, v, knobs.judge(key, v, facts)) for key, v in values.items()]
    return device, [f"{key}={v}: {why}" for key, v, why in judged if why]


def _device_facts(spec: TrialSpec) -> dict[str, Any]:
    """This process's devices as `check_device_facts` reads them, as cheaply as the trial allows:
    GPUs only where it may run on one (a CPU trial creates no CUDA context), the bf16 of the GPU
    only where it asks for bf16 (torch's answer may put a tensor there), why none is visible
    only where one is asked for (that may run nvidia-smi)."""
    import torch

    requested, dist = spec.device.type, spec.distributed
    devices: list[dict[str, Any]] = [{"device": "cpu"}]
    count = torch.cuda.device_count() if requested not in ("cpu", "mps") else 0
    wanted = (torch.device(requested).index or 0) if requested.startswith("cuda") else None
    bf16 = "bf16" in (spec.precision.mode, dist.param_dtype, dist.reduce_dtype)
    for index in sorted(range(count), key=lambda i: i != torch.cuda.current_device()):
        fact = _cuda_facts(index)
        if bf16 and index == (torch.cuda.current_device() if wanted is None else wanted):
            with torch.cuda.device(index):
                fact["bf16"] = torch.cuda.is_bf16_supported()
        devices.append(fact)
    if requested in ("mps", "auto") and torch.backends.mps.is_available():
        devices.append({"device": "mps"})
    why = None
    if requested.startswith("cuda") and not count:
        why = why_no_accelerator() or {"why": "CUDA is not available"}
    return {"devices": devices, "accelerator": why}
