"""Devices, the environment fingerprint, device capabilities, the measured matmul peak (a short
probe per device and dtype, cached per hardware fingerprint), and `python -m gpuopt.env`.

The fingerprint goes into every result, so numbers from different machines or software never mix
silently. `detect_capabilities` says which settings are poor choices on a device; the sweeper runs
`python -m gpuopt.env --json` in a subprocess (so its own process never imports torch) and drops
those choices from preset search spaces.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gpuopt
from gpuopt.core.errors import ConfigError
from gpuopt.core.host import cpu_model
from gpuopt.core.spec import TrialSpec

if TYPE_CHECKING:
    import torch

# Values of count-like knobs the capabilities check rates against the core count.
_THREAD_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def usable_cpus() -> int:
    """CPUs this process may run on (cgroup/affinity aware where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


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


# -- the measured peak: a short matmul probe per device and dtype, cached per hardware --------------
# Precision mode -> (torch dtype name, float32 matmul precision the probe runs under).
PROBE_MODES = {
    "fp32": ("float32", "highest"),
    "tf32": ("float32", "high"),
    "bf16": ("bfloat16", "highest"),
    "fp16": ("float16", "highest"),
}
PROBE_BUDGET_S = 0.2  # per dtype, first measurement on a machine; later calls read the cache
# Square matmul sizes tried: (first, largest) per device type.
PROBE_SIZES = {"cpu": (128, 2048)}
PROBE_DEFAULT_SIZES = (1024, 8192)
PROBE_REPS = 5  # timed repetitions per size (best of)
# The fingerprint fields that name the hardware (and driver) a probe ran on.
HARDWARE_KEYS = (
    "device_name",
    "cpu_model",
    "usable_cpus",
    "compute_capability",
    "device_memory_mb",
    "driver",
    "hostname",
)


def cache_dir() -> Path:
    """Where gpuopt caches measurements of the machine: $GPUOPT_CACHE_DIR, else
    $XDG_CACHE_HOME/gpuopt, else ~/.cache/gpuopt."""
    explicit = os.environ.get("GPUOPT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuopt"


def probe_key(fp: dict[str, Any], mode: str, threads: int) -> str:
    """The cache key of one probe: the hardware fingerprint, the precision mode, the compute
    threads and the torch version (a new torch can bring new kernels)."""
    hardware = {k: fp.get(k) for k in HARDWARE_KEYS}
    return json.dumps(
        {"hardware": hardware, "mode": mode, "threads": threads, "torch": fp.get("torch")},
        sort_keys=True,
    )


def _time_matmul(device: torch.device, dtype: torch.dtype, n: int, deadline: float) -> float:
    """The best seconds of one n x n matmul over PROBE_REPS repetitions (after one untimed)."""
    import time

    import torch

    from gpuopt.trial.measure import synchronize

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    synchronize(device)
    best = float("inf")
    for _ in range(PROBE_REPS):
        started = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - started)
        if time.perf_counter() >= deadline:
            break
    return best


def measure_peak_flops(device: torch.device, mode: str, budget_s: float = PROBE_BUDGET_S) -> float:
    """Achievable dense matmul FLOP/s for a precision mode: square matmuls of growing size (2n^3
    FLOPs each), best of a few repetitions, until a size would not fit the budget. A slow
    (emulated) dtype stops at small sizes, so the probe stays short whatever the dtype."""
    import time

    import torch

    dtype_name, matmul_precision = PROBE_MODES[mode]
    dtype = getattr(torch, dtype_name)
    n, max_n = PROBE_SIZES.get(device.type, PROBE_DEFAULT_SIZES)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    started = time.perf_counter()
    deadline = started + budget_s
    best = 0.0
    try:
        while True:
            seconds = _time_matmul(device, dtype, n, deadline)
            best = max(best, 2 * n**3 / seconds)
            remaining = deadline - time.perf_counter()
            # The next size costs ~8x per matmul, PROBE_REPS + 1 of them.
            if n * 2 > max_n or 8 * seconds * (PROBE_REPS + 1) > remaining:
                return best
            n *= 2
    finally:
        torch.set_float32_matmul_precision(previous)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    """Atomically (trials in parallel processes may write at once: the last writer wins)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the probe is re-run next time, nothing else breaks


def probed_peak_flops(
    device: torch.device,
    mode: str,
    fp: dict[str, Any] | None = None,
    cache: Path | None = None,
) -> float | None:
    """The measured peak FLOP/s of `device` for a precision mode, from the cache file
    (`cache_dir()/peak_flops.json`, keyed by `probe_key`) or probed now and cached.

    On CPU the probe runs on one thread and the peak is that per-core rate times the usable cores
    (as a datasheet peak is stated): a probe on every core of a shared machine times its slowest
    thread (OpenMP's barriers wait for a descheduled one) and would cache a fraction of the
    machine. The caller's thread count is restored. None for a mode the probe does not know."""
    import torch

    if mode not in PROBE_MODES:
        return None
    fp = fp if fp is not None else fingerprint(device)
    threads = 1 if device.type == "cpu" else torch.get_num_threads()
    scale = usable_cpus() if device.type == "cpu" else 1
    path = cache if cache is not None else cache_dir() / "peak_flops.json"
    key = probe_key(fp, mode, threads)
    cached = _read_cache(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("flops"), (int, float)):
        return float(cached["flops"]) * scale
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = measure_peak_flops(device, mode)
    finally:
        torch.set_num_threads(previous)
    data = _read_cache(path)
    data[key] = {"flops": flops, "threads": threads}
    _write_cache(path, data)
    return flops * scale


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
    if precision:
        poor["precision.mode"] = precision
        poor["precision"] = dict(precision)
    if compile_modes:
        poor["compile.mode"] = compile_modes
        poor["compile"] = dict(compile_modes)
    caps["poor_choices"] = {key: value for key, value in poor.items() if value}
    return caps


def check_device_support(spec: TrialSpec) -> tuple[torch.device, list[str]]:
    """Resolve the device and reject settings it cannot run (ConfigError); return warnings for
    settings that run but do nothing here."""
    import torch

    requested = spec.device.type
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            why = why_no_accelerator() or {"why": "CUDA is not available"}
            raise ConfigError("device.type", requested, f"cpu | auto here ({why['why']})")
        index = torch.device(requested).index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                "device.type",
                requested,
                f"cuda:0 .. cuda:{torch.cuda.device_count() - 1} | cpu | auto",
            )
    if requested == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device.type", requested, "cpu | auto here (MPS is not available)")
    device = resolve_device(requested)
    mode = spec.precision.mode
    if mode == "tf32" and (
        device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8
    ):
        where = device_name(device) if device.type == "cuda" else device.type
        raise ConfigError(
            "precision.mode",
            mode,
            f"fp32 | fp16 | bf16 on {where} (tf32 needs an NVIDIA GPU "
            "with compute capability >= 8.0)",
        )
    if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision.mode", mode, f"fp32 | fp16 on {device_name(device)} (no bf16)")
    warnings = []
    if device.type == "cpu":
        if spec.loader.pin_memory:
            warnings.append("loader.pin_memory=true has no effect without an accelerator")
        if spec.loader.non_blocking:
            warnings.append(
                "loader.non_blocking=true has no effect on CPU (no host-to-device copy)"
            )
        if mode == "bf16" and not cpu_bf16_native():
            warnings.append(
                "precision.mode=bf16 on a CPU without native bf16: emulated, expect it slow"
            )
    if spec.compile.mode in ("reduce-overhead", "max-autotune") and device.type != "cuda":
        warnings.append(
            f"compile.mode={spec.compile.mode} targets CUDA; on {device.type} expect no gain"
        )
    return device, warnings


def _print_human(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="Devices gpuopt sees")
    for column in ("device", "name", "details"):
        table.add_column(column)
    for d in data["devices"]:
        details = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("device", "name"))
        table.add_row(d["device"], d["name"], details)
    console.print(table)
    fp = Table(title="Environment fingerprint", show_header=False)
    for key, value in data["fingerprint"].items():
        fp.add_row(key, str(value))
    console.print(fp)
    console.print(f"[bold]Default device:[/bold] {data['device']} ({data['device_name']})")
    if data.get("peak_flops"):
        peaks = ", ".join(
            f"{mode} {flops / 1e12:.3g} TFLOP/s" for mode, flops in data["peak_flops"].items()
        )
        console.print(f"[bold]Measured matmul peak:[/bold] {peaks} (cached in {cache_dir()})")
    if data.get("accelerator"):
        console.print(f"[yellow]No accelerator visible:[/yellow] {data['accelerator']['why']}")
        console.print(f"  What to do: {data['accelerator']['what_to_do']}")
    if data["poor_choices"]:
        poor = Table(title=f"Poor choices on {data['device']} (dropped from preset search spaces)")
        for column in ("key", "value", "why"):
            poor.add_column(column)
        for key, values in data["poor_choices"].items():
            if key in ("precision", "compile", "loader.num_workers", "device.num_threads"):
                continue  # duplicates of precision.mode / compile.mode; long count lists
            for value, reason in values.items():
                poor.add_row(key, value, reason)
        console.print(poor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuopt.env", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    parser.add_argument(
        "--no-probe", action="store_true", help="skip the measured matmul peak (cached per machine)"
    )
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    data = detect_capabilities(device)
    data["fingerprint"] = fingerprint(device)
    if not args.no_probe:
        data["peak_flops"] = {
            mode: probed_peak_flops(device, mode, data["fingerprint"])
            for mode in supported_modes(device)
        }
    data["devices"] = list_devices()
    data["accelerator"] = why_no_accelerator()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_human(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
