"""Which GPUs each parallel trial sees: one job per GPU (or per group of GPUs), never shared.

Parallel trials on one GPU interfere (they time-share the SMs and the memory bandwidth), so with
`hydra.sweeper.n_jobs > 1` the launcher gives job k of a batch its own slice of the GPUs this
sweeping process sees, through CUDA_VISIBLE_DEVICES in the trial's environment. Pure functions
(NVML only in `nvml_uuids`): the launcher and the tests share them.

Ids: when this process's CUDA_VISIBLE_DEVICES is set, its entries are handed out as they are (they
mean what they mean to the user's CUDA_DEVICE_ORDER, which the trials inherit). When it is unset,
trials are pinned by UUID: NVML numbers GPUs in PCI bus order while CUDA numbers them fastest
first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, so an NVML index can name another GPU in the trial.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)


def visible_gpus(environ: Mapping[str, str], nvml_count: int) -> list[str] | None:
    """The GPU ids this process may hand out: CUDA_VISIBLE_DEVICES (ids or UUIDs) when set, else
    NVML's indices. None when the variable is unset and NVML sees no GPU (nothing to pin)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [g.strip() for g in value.split(",") if g.strip() and g.strip() != "-1"]
    return [str(i) for i in range(nvml_count)] if nvml_count else None


def nvml_strings(query: str, nvml: Any = None) -> list[str]:
    """Each GPU's `query` (an NVML device getter: nvmlDeviceGetUUID, nvmlDeviceGetName) in NVML's
    order (PCI bus order); [] without a driver."""
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
    """The GPU ids this process may hand out to its trials: CUDA_VISIBLE_DEVICES's entries when
    set, else NVML's UUIDs (`uuids()`, default `nvml_uuids`; order-proof, see the module doc).
    None: nothing to pin."""
    if environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return visible_gpus(environ, 0)
    return (uuids or nvml_uuids)() or None


def assign(gpus: Sequence[str], n_jobs: int, slot: int, per_job: int | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for job `slot` (0-based) of a batch of `n_jobs`.

    - per_job (hydra.launcher.gpus_per_node) set: job k gets GPUs k*per_job .. k*per_job+per_job-1,
      disjoint while n_jobs * per_job <= len(gpus), else wrapping round (shared; see
      `sharing_warning`); never more than len(gpus).
    - per_job unset, n_jobs <= len(gpus): each job gets len(gpus) // n_jobs GPUs of its own
      (leftovers unused).
    - per_job unset, n_jobs > len(gpus): jobs share GPUs round-robin (measurements interfere).
    - no GPUs: "" (the trial sees none).
    """
    if not 0 <= slot < n_jobs:
        raise ValueError(f"slot {slot} outside a batch of {n_jobs} jobs")
    if not gpus:
        return ""
    if per_job is None:
        if n_jobs > len(gpus):
            return gpus[slot % len(gpus)]
        per_job = len(gpus) // n_jobs
    per_job = min(max(per_job, 0), len(gpus))
    first = slot * per_job
    return ",".join(gpus[(first + k) % len(gpus)] for k in range(per_job))


def sharing_warning(gpu_count: int, n_jobs: int, per_job: int | None = None) -> str | None:
    """Why `assign` must let parallel trials share GPUs (their measurements interfere), or
    None when every job gets GPUs of its own."""
    if gpu_count <= 0:
        return None
    if per_job is None:
        if n_jobs <= gpu_count:
            return None
        return (
            f"{n_jobs} parallel trials on {gpu_count} GPU(s): trials share GPUs and their "
            f"measurements interfere (lower hydra.sweeper.n_jobs to {gpu_count})"
        )
    if per_job > gpu_count:
        return (
            f"hydra.launcher.gpus_per_node={per_job} but {gpu_count} GPU(s) visible: each trial "
            f"gets {gpu_count}" + (" and they share them" if n_jobs > 1 else "")
        )
    if n_jobs * per_job <= gpu_count:
        return None
    return (
        f"{n_jobs} parallel trials x {per_job} GPU(s) on {gpu_count} GPU(s): trials share GPUs "
        f"and their measurements interfere (lower hydra.sweeper.n_jobs to "
        f"{max(1, gpu_count // max(per_job, 1))})"
    )


def setup_line(value: str | None) -> str:
    """The shell line that gives a trial process `value` as CUDA_VISIBLE_DEVICES (None: unset)."""
    if value is None:
        return "unset CUDA_VISIBLE_DEVICES"
    return f"export CUDA_VISIBLE_DEVICES={shlex.quote(value)}"
