"""Failures are results: how a trial's exception becomes its status (oom, diverged, error), the
same in every engine, the public callback and the sweeper's probing processes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gpuopt.core.result import Status

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Diverged(Exception):
    """The loss became NaN or inf."""


# Out-of-memory as the CUDA libraries report it (e.g. "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when
# calling `cublasCreate(handle)`"): a RuntimeError / torch.AcceleratorError, not an OutOfMemoryError.
LIBRARY_OOM_STATUSES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_oom(exc: BaseException) -> bool:
    """torch's, the CPU allocator's, MPS's and cuBLAS/cuDNN's out-of-memory errors."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text
        or "out of memory" in text.lower()
        or any(status in text for status in LIBRARY_OOM_STATUSES)
    )


def classify_failure(exc: Exception) -> tuple[Status, str]:
    """The status and reason of a trial that raised `exc` (errors are also logged with traceback)."""
    if isinstance(exc, Diverged):
        return Status.DIVERGED, str(exc)
    if is_oom(exc):
        status = Status.OOM
    else:
        status = Status.ERROR
        log.warning("trial failed", exc_info=exc)
    return status, f"{type(exc).__name__}: {str(exc).strip()}"


class NonFiniteLoss:
    """A device-side flag: whether any loss so far was NaN/inf. Updated without a host sync (reading
    the loss on the host each step would sync every step); read only at window ends."""

    def __init__(self) -> None:
        self.flag: torch.Tensor | None = None

    def update(self, loss: torch.Tensor | None) -> None:
        import torch

        if loss is None:
            return
        if self.flag is None:
            self.flag = torch.zeros((), dtype=torch.bool, device=loss.device)
        torch.logical_or(self.flag, ~torch.isfinite(loss.detach()), out=self.flag)

    def check(self, phase: str) -> None:
        if self.flag is not None and bool(self.flag):  # a CPU-GPU sync point: window ends only
            raise Diverged(f"loss became NaN/inf during {phase}")
