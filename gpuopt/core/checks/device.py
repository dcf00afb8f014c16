"""The device rules, torch-free: what a config needs of the device it runs on, against that
machine's facts (the sweeper's from `python -m gpuopt.env --json`, a trial's from torch), so a bad
device fails with the same line on either side.
"""

from __future__ import annotations

from typing import Any

from gpuopt.core.errors import ConfigError, check_per_cpu


def check_device_facts(conf: Any, facts: dict[str, Any]) -> None:
    """What the device must offer for `conf` (read by attribute), against `facts`: `devices`
    ({"device", "compute_capability", optionally "name" and "bf16"} each), optionally
    `accelerator` ({"why"} when none is visible) and `cpus`. Raises `ConfigError`."""
    device_type = str(conf.device.type)
    devices = {str(d.get("device")): d for d in facts.get("devices", [])}
    cuda = [name for name in devices if name.startswith("cuda")]
    why = (facts.get("accelerator") or {}).get("why")
    here = f"cpu | auto here ({why})" if why else "cpu | auto here"
    if device_type == "cuda" and not cuda:
        raise ConfigError("device.type", device_type, here)
    if device_type.startswith("cuda:") and device_type not in devices:
        listed = " | ".join([*cuda, "cpu", "auto"])
        raise ConfigError("device.type", device_type, listed if cuda else here)
    if device_type == "mps" and "mps" not in devices:
        raise ConfigError("device.type", device_type, "cpu | auto here (MPS is not available)")
    resolved = _resolve_device(device_type, cuda, devices)
    fact = devices.get(resolved, {})
    sm80 = float(fact.get("compute_capability") or "0.0") >= 8.0
    # bf16 on CUDA: torch's answer where the facts have it, else compute capability >= 8.0; a
    # CPU's emulated bf16 runs, only slowly (the search trims it).
    bf16 = fact.get("bf16", sm80) if resolved.startswith("cuda") else True
    _check_precision(str(conf.precision.mode), resolved, sm80, fact)
    _check_distributed(conf.distributed, resolved.split(":")[0], len(cuda), bf16)
    cpus = facts.get("cpus")
    if isinstance(cpus, int) and cpus > 0:
        check_per_cpu("loader.num_workers", conf.loader.num_workers, 0, cpus, "worker processes")
        if conf.device.num_threads is not None:
            check_per_cpu("device.num_threads", conf.device.num_threads, 1, cpus, "threads")


def _resolve_device(device_type: str, cuda: list[str], devices: dict[str, Any]) -> str:
    """`auto` -> the first CUDA device listed, then mps, then cpu (as
    gpuopt.trial.devices.resolve_device); `cuda` -> cuda:0."""
    if device_type == "cuda":
        return "cuda:0"
    if device_type != "auto":
        return device_type
    return cuda[0] if cuda else "mps" if "mps" in devices else "cpu"


def _check_precision(mode: str, resolved: str, sm80: bool, fact: dict[str, Any]) -> None:
    """tf32 needs an NVIDIA GPU of compute capability >= 8.0; bf16 a GPU torch says has it."""
    if mode == "tf32" and (not resolved.startswith("cuda") or not sm80):
        raise ConfigError(
            "precision.mode",
            mode,
            f"fp32 | fp16 | bf16 on {resolved} (tf32 needs an NVIDIA GPU with compute capability "
            ">= 8.0)",
        )
    if mode == "bf16" and fact.get("bf16") is False:
        raise ConfigError("precision.mode", mode, f"fp32 | fp16 on {fact.get('name')} (no bf16)")


def _check_distributed(dist: Any, device_type: str, cuda_devices: int, bf16: bool) -> None:
    """What the distributed group needs of the device: NCCL only on CUDA, no more ranks per node
    than GPUs, no bf16 shards where the device has no bf16."""
    if dist.kind == "none":
        return
    if dist.backend == "nccl" and device_type != "cuda":
        raise ConfigError(
            "distributed.backend", "nccl", f"auto | gloo on {device_type} (NCCL needs CUDA GPUs)"
        )
    if device_type == "cuda" and dist.nproc_per_node > cuda_devices:
        raise ConfigError(
            "distributed.nproc_per_node",
            dist.nproc_per_node,
            f"1 to {cuda_devices} here (one rank per visible GPU)",
        )
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(dist, key) == "bf16" and not bf16:
            raise ConfigError(
                f"distributed.{key}", "bf16", f"fp32 | fp16 | null on this {device_type} (no bf16)"
            )
