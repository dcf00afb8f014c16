"""Which GPUs each parallel trial sees: one job per GPU (or per group of GPUs), never shared.

Parallel trials on one GPU interfere (they time-share the SMs and the memory bandwidth), so with
`hydra.sweeper.n_jobs > 1` the launcher gives job k of a batch its own slice of the GPUs this
sweeping process sees, through CUDA_VISIBLE_DEVICES in the trial's environment. Pure functions:
the launcher and the tests share them.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

# user attr on each trial: the CUDA_VISIBLE_DEVICES value its process got (absent: not pinned)
ATTR_VISIBLE_DEVICES = "cuda_visible_devices"


def visible_gpus(environ: Mapping[str, str], nvml_count: int) -> list[str] | None:
    """The GPU ids this process may hand out: CUDA_VISIBLE_DEVICES (ids or UUIDs) when set, else
    NVML's indices. None when the variable is unset and NVML sees no GPU (nothing to pin)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        return [g.strip() for g in value.split(",") if g.strip() and g.strip() != "-1"]
    return [str(i) for i in range(nvml_count)] if nvml_count else None


def assign(gpus: Sequence[str], n_jobs: int, slot: int) -> str:
    """CUDA_VISIBLE_DEVICES for job `slot` (0-based) of a batch of `n_jobs`.

    - n_jobs <= len(gpus): each job gets len(gpus) // n_jobs GPUs of its own (leftovers unused).
    - n_jobs > len(gpus): jobs share GPUs round-robin (the sweeper warns: measurements interfere).
    - no GPUs: "" (the trial sees none).
    """
    if not 0 <= slot < n_jobs:
        raise ValueError(f"slot {slot} outside a batch of {n_jobs} jobs")
    if not gpus:
        return ""
    if n_jobs > len(gpus):
        return gpus[slot % len(gpus)]
    per_job = len(gpus) // n_jobs
    return ",".join(gpus[slot * per_job : (slot + 1) * per_job])


def setup_line(value: str | None) -> str:
    """The shell line that gives a trial process `value` as CUDA_VISIBLE_DEVICES (None: unset)."""
    if value is None:
        return "unset CUDA_VISIBLE_DEVICES"
    return f"export CUDA_VISIBLE_DEVICES={shlex.quote(value)}"
