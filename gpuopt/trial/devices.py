"""The devices of a trial's process, on the torch side: resolving the one a trial runs on (once,
`trial_device`), what it is (`fingerprint`, `list_devices`, `why_no_accelerator`) and what it does
well (`detect_capabilities`: the poor choices the sweeper drops from preset search spaces).

The fingerprint goes into every result, so numbers from different machines or software never mix
silently. The sweeper reads these facts through `python -m gpuopt.env --json` in a subprocess (so
its own process never imports torch); the measured matmul peak is `gpuopt.trial.matmul_peak`.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gpuopt
from gpuopt.core.distributed_checks import check_distributed_device
from gpuopt.core.errors import ConfigError
from gpuopt.core.host import cpu_model, usable_cpus

if TYPE_CHECKING:
    import torch

    from gpuopt.core.spec import TrialSpec

# Values of count-like knobs the capabilities check rates against the core count.
_THREAD_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def resolve_device(device_type: str) -> torch.device:
    """`auto` -> cuda if available, then mps, then cpu; anything else as given.

    A CUDA device is made current and initialized here: allocations, streams and events without
    an explicit device then go to cuda:N, not cuda:0, and the allocator statistics
    (reset_peak_memory_stats) exist before the first tensor does (pytorch#72404)."""
    import torch

    if device_type == "auto":
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        elif torch.backends.mps.is_available():
            return torch.device("mps")
        else:
            return torch.device("cpu")
    else:
        device = torch.device(device_type)
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
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
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


def fingerprint(device: torch.device | None = None) -> dict[str, Any]:
    """Facts that change measured numbers: hardware, driver, software versions, host."""
    import torch

    device = device if device is not None else resolve_device("auto")
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
        major, minor = torch.cuda.get_device_capability(device)
        info["compute_capability"] = f"{major}.{minor}"
        info["device_memory_mb"] = round(
            torch.cuda.get_device_properties(device).total_memory / 2**20
        )
    return info


def supported_modes(device: torch.device) -> list[str]:
    """The precision modes a device can run (tf32 needs compute capability >= 8.0)."""
    import torch

    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        modes = ["fp32", "tf32", "fp16"] if major >= 8 else ["fp32", "fp16"]
        return modes + (["bf16"] if torch.cuda.is_bf16_supported() else [])
    return ["fp32", "bf16", "fp16"]


def list_devices() -> list[dict[str, Any]]:
    import torch

    devices = [{"device": "cpu", "name": cpu_model(), "cores": usable_cpus()}]
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            {
                "device": f"cuda:{index}",
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "memory_mb": round(props.total_memory / 2**20),
            }
        )
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


def cpu_bf16_native() -> bool:
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_fp16_native() -> bool:
    import torch

    check = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    return bool(check()) if check is not None else False


def _cpu_choices(
    caps: dict[str, Any],
    precision: dict[str, str],
    compile_modes: dict[str, str],
    poor: dict[str, dict[str, str]],
) -> None:
    """detect_capabilities on a CPU: native bf16/fp16 math, and what does nothing without an
    accelerator (filled into detect_capabilities' tables)."""
    bf16, fp16 = cpu_bf16_native(), cpu_fp16_native()
    caps.update(bf16_native=bf16, fp16_native=fp16, tf32=False)
    if not bf16:
        precision["bf16"] = (
            "this CPU has no native bf16 (no AVX512-BF16/AMX): autocast emulates it, "
            "measured 3-15x slower than fp32"
        )
    if not fp16:
        precision["fp16"] = (
            "this CPU has no native fp16 math (no AMX-FP16): fp16 autocast plus loss scaling "
            "is slower than fp32"
        )
    precision["tf32"] = "TF32 needs an NVIDIA GPU with compute capability >= 8.0"
    poor["loader.pin_memory"] = {
        "true": "no accelerator: pinned memory is a no-op here (PyTorch warns)"
    }
    poor["loader.non_blocking"] = {"true": "no accelerator: there is no host-to-device copy"}
    compile_modes["default"] = (
        "torch.compile costs ~30 s cold per process on CPU (measured 27-38 s on 2 cores) and "
        "gave no measurable speed-up for these models"
    )
    compile_modes["reduce-overhead"] = "CUDA graphs: needs a CUDA device to pay off"
    compile_modes["max-autotune"] = "autotunes GPU kernels: needs a CUDA device to pay off"


# A low precision whose measured matmul peak is under this many times fp32's buys no compute here.
LOW_PRECISION_GAIN = 1.2


def slow_precisions(peak_flops: dict[str, float]) -> dict[str, str]:
    """The low precisions (bf16, fp16) that the measured matmul peaks (`python -m gpuopt.env`'s
    probe, gpuopt.trial.matmul_peak) say are no faster than fp32 here, with the reason.

    Why measured, not read off CPU flags: a CPU can have native fp16 instructions (AVX512-FP16)
    and still no faster fp16 matrix math (AMX-FP16 is a later chip), so fp16 autocast only adds
    rounding and conversions - and its convolutions have no fast kernel at all (on a 2-core Xeon
    with AVX512-FP16, a 3x3 conv's forward and backward took 2.2 s in fp16 vs 60 ms in fp32:
    docs/searching.md, "Device-aware choices"). A trial of such a configuration costs a sweep minutes for nothing."""
    fp32 = peak_flops.get("fp32")
    slow = {}
    for mode in ("bf16", "fp16"):
        peak = peak_flops.get(mode)
        if fp32 and peak and peak < LOW_PRECISION_GAIN * fp32:
            slow[mode] = (
                f"measured matmul peak {peak / 1e12:.3g} TFLOP/s, {peak / fp32:.2f}x fp32's: "
                "no faster math here to pay for its rounding"
            )
    return slow


def add_slow_precisions(data: dict[str, Any]) -> None:
    """`detect_capabilities`' poor choices, with the precisions the measured peaks in
    `data["peak_flops"]` say are slow here (those not already poor for another reason)."""
    slow = slow_precisions(data.get("peak_flops") or {})
    poor = data.setdefault("poor_choices", {})
    for key in ("precision.mode", "precision"):
        listed = poor.setdefault(key, {})
        for mode, why in slow.items():
            listed.setdefault(mode, why)
        if not listed:
            del poor[key]


def detect_capabilities(device: torch.device | str | None = None) -> dict[str, Any]:
    """What the device does well, and `poor_choices`: {config key: {override value: reason}}.

    Values are strings as they would appear in a Hydra override. Group options (`precision=bf16`,
    `compile=max-autotune`) are listed under the group name too, so a sweeper searching groups
    and one searching keys read the same answer.
    """
    import torch

    if device is None or isinstance(device, str):
        device = resolve_device(device or "auto")
    cores = usable_cpus()
    precision: dict[str, str] = {}
    compile_modes: dict[str, str] = {}
    poor: dict[str, dict[str, str]] = {}
    caps: dict[str, Any] = {
        "device": device.type,
        "device_name": device_name(device),
        "cpus": cores,
    }

    if device.type == "cpu":
        _cpu_choices(caps, precision, compile_modes, poor)
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        caps.update(compute_capability=f"{major}.{minor}", tf32=major >= 8, bf16_native=major >= 8)
        if major < 8:
            precision["tf32"] = (
                f"TF32 needs compute capability >= 8.0; this GPU has {major}.{minor}"
            )
            precision["bf16"] = (
                f"no native bf16 below compute capability 8.0 (this GPU: {major}.{minor}): emulated, slow"
            )
    elif device.type == "mps":
        caps.update(tf32=False)
        precision["tf32"] = "TF32 needs an NVIDIA GPU with compute capability >= 8.0"
        compile_modes["reduce-overhead"] = "CUDA graphs: needs a CUDA device to pay off"
        compile_modes["max-autotune"] = "autotunes GPU kernels: needs a CUDA device to pay off"

    # Compute threads and loader workers share the CPU cores (with an accelerator too, where
    # workers compete with the thread that launches kernels).
    poor["device.num_threads"] = {
        str(n): f"only {cores} usable CPU core(s): more threads than cores oversubscribe"
        for n in _THREAD_CANDIDATES
        if n > cores
    }
    poor["loader.num_workers"] = {
        str(n): f"only {cores} usable CPU core(s): more workers than cores compete with compute"
        for n in _THREAD_CANDIDATES
        if n > cores
    }
    _distributed_choices(device, caps, cores, poor)
    if precision:
        poor["precision.mode"] = precision
        poor["precision"] = dict(precision)
    if compile_modes:
        poor["compile.mode"] = compile_modes
        poor["compile"] = dict(compile_modes)
    caps["poor_choices"] = {key: value for key, value in poor.items() if value}
    return caps


def _distributed_choices(
    device: torch.device, caps: dict[str, Any], cores: int, poor: dict[str, dict[str, str]]
) -> None:
    """What a distributed trial cannot do well here (`distributed=ddp | fsdp2`): NCCL without CUDA,
    more ranks than GPUs (or, on CPU, than cores), bf16 shards without native bf16."""
    import torch

    if device.type == "cuda":
        ranks, what = torch.cuda.device_count(), "GPU(s)"
    else:
        ranks, what = cores, "usable CPU core(s)"
        poor["distributed.backend"] = {"nccl": "NCCL needs CUDA GPUs"}
    poor["distributed.nproc_per_node"] = {
        str(n): f"only {ranks} {what}: one rank each" for n in _THREAD_CANDIDATES if n > ranks
    }
    if not caps.get("bf16_native"):
        why = "no native bf16 on this device: bf16 shards run emulated, slowly"
        poor["distributed.param_dtype"] = {"bf16": why}
        poor["distributed.reduce_dtype"] = {"bf16": why}


def trial_device(spec: TrialSpec) -> tuple[torch.device, list[str]]:
    """The device a trial runs on, resolved once (`resolve_device`), with the warnings for settings
    that run but do nothing there. Raises ConfigError for a device that is not here and for settings
    it cannot run (the same lines `gpuopt.core.checks.check_device_facts` gives from facts)."""
    import torch

    requested = spec.device.type
    _check_present(requested)
    device = resolve_device(requested)
    mode = spec.precision.mode
    if mode == "tf32" and (
        device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8
    ):
        raise ConfigError(
            "precision.mode",
            mode,
            f"fp32 | fp16 | bf16 on {device} (tf32 needs an NVIDIA GPU "
            "with compute capability >= 8.0)",
        )
    if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision.mode", mode, f"fp32 | fp16 on {device_name(device)} (no bf16)")
    cuda = device.type == "cuda"
    check_distributed_device(
        spec.distributed,
        device.type,
        torch.cuda.device_count() if cuda else 0,
        torch.cuda.is_bf16_supported() if cuda else True,  # a CPU emulates bf16 (slowly)
    )
    return device, _no_effect_warnings(spec, device)


def _check_present(requested: str) -> None:
    """A requested CUDA or MPS device must be visible here (ConfigError naming what is)."""
    import torch

    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            why = why_no_accelerator() or {"why": "CUDA is not available"}
            raise ConfigError("device.type", requested, f"cpu | auto here ({why['why']})")
        count = torch.cuda.device_count()
        if (torch.device(requested).index or 0) >= count:
            listed = [f"cuda:{index}" for index in range(count)]
            raise ConfigError("device.type", requested, " | ".join([*listed, "cpu", "auto"]))
    if requested == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device.type", requested, "cpu | auto here (MPS is not available)")


def _no_effect_warnings(spec: TrialSpec, device: torch.device) -> list[str]:
    """Settings that run on `device` but do nothing there (or run emulated)."""
    warnings = []
    if device.type == "cpu":
        if spec.loader.pin_memory:
            warnings.append("loader.pin_memory=true has no effect without an accelerator")
        if spec.loader.non_blocking:
            warnings.append(
                "loader.non_blocking=true has no effect on CPU (no host-to-device copy)"
            )
        if spec.precision.mode == "bf16" and not cpu_bf16_native():
            warnings.append(
                "precision.mode=bf16 on a CPU without native bf16: emulated, expect it slow"
            )
    if spec.compile.mode in ("reduce-overhead", "max-autotune") and device.type != "cuda":
        warnings.append(
            f"compile.mode={spec.compile.mode} targets CUDA; on {device.type} expect no gain"
        )
    return warnings
