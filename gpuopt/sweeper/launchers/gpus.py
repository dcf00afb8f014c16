"""Which GPUs each parallel trial sees (CUDA_VISIBLE_DEVICES): one job per GPU or group, never
shared, since parallel trials on one GPU time-share it and their measurements interfere.

This process's CUDA_VISIBLE_DEVICES entries are handed out as they are (they mean what they mean to
the user's CUDA_DEVICE_ORDER); when it is unset, trials are pinned by UUID: NVML numbers GPUs in
PCI bus order, CUDA fastest first, so an NVML index can name another GPU in the trial.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def nvml_strings(query: str, nvml: Any = None) -> list[str]:
    """Each GPU's `query` (nvmlDeviceGetUUID, nvmlDeviceGetName) in NVML's order; [] without a
    driver."""
    try:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py

        nvml.nvmlInit()
    except Exception:
        return []
    try:
        get = getattr(nvml, query)
        values = [get(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
        return [v.decode() if isinstance(v, bytes) else str(v) for v in values]
    except Exception:
        return []
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def nvml_uuids(nvml: Any = None) -> list[str]:
    """The GPUs' UUIDs in NVML's order; [] without a driver."""
    return nvml_strings("nvmlDeviceGetUUID", nvml)


def pinnable_gpus(
    environ: Mapping[str, str], uuids: Callable[[], list[str]] | None = None
) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES's entries when set, else NVML's UUIDs (`uuids()`); None: nothing to
    pin."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [g.strip() for g in value.split(",") if g.strip() not in ("", "-1")]
    return (uuids or nvml_uuids)() or None


def assign(gpus: Sequence[str], n_jobs: int, slot: int, per_job: int | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for job `slot` of a batch of `n_jobs`: `per_job`
    (hydra.launcher.gpus_per_node) GPUs each, else an even share; wrapping round (shared) when
    there are too few."""
    if not gpus:
        return ""
    if per_job is None:
        per_job = max(1, len(gpus) // n_jobs)
    per_job = min(max(per_job, 0), len(gpus))
    first = slot * per_job
    return ",".join(gpus[(first + k) % len(gpus)] for k in range(per_job))


def sharing_warning(gpu_count: int, n_jobs: int, per_job: int | None = None) -> str | None:
    """Why `assign` must let parallel trials share GPUs, or None."""
    if gpu_count <= 0:
        return None
    if per_job is not None and per_job > gpu_count:
        return (
            f"hydra.launcher.gpus_per_node={per_job} but {gpu_count} GPU(s) visible: each trial "
            f"gets {gpu_count}" + (" and they share them" if n_jobs > 1 else "")
        )
    each = 1 if per_job is None else per_job
    if n_jobs * each <= gpu_count:
        return None
    size = "" if per_job is None else f" x {per_job} GPU(s)"
    return (
        f"{n_jobs} parallel trials{size} on {gpu_count} GPU(s): trials share GPUs and their "
        f"measurements interfere (lower hydra.sweeper.n_jobs to {max(1, gpu_count // max(each, 1))})"
    )


def setup_line(value: str | None) -> str:
    """The shell line setting CUDA_VISIBLE_DEVICES to `value` (None: unset)."""
    if value is None:
        return "unset CUDA_VISIBLE_DEVICES"
    return f"export CUDA_VISIBLE_DEVICES={shlex.quote(value)}"
