"""Failures are results: how an exception of a trial becomes its status (oom, diverged, error).

Every engine, the public callback and the sweeper's probing processes classify the same way, so
the same failure reads the same everywhere: out-of-memory (torch's, the CPU allocator's, MPS's, and
cuBLAS/cuDNN's allocation failures) -> oom, a NaN/inf loss (`Diverged`, raised by `NonFiniteLoss`
at window ends) -> diverged, anything else -> error with the exception's type and message.
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


# Out-of-memory as the CUDA libraries report it: a workspace or handle they could not allocate
# (e.g. "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
# "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), raised as a RuntimeError / torch.AcceleratorError,
# not as torch.OutOfMemoryError.
LIBRARY_OOM_STATUSES = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), the CPU allocator's failure, MPS's out-of-memory error,
    and cuBLAS/cuDNN allocation failures (LIBRARY_OOM_STATUSES)."""
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
