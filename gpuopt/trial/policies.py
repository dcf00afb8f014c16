"""Policies a trial applies around the training step: allocator environment, threads, precision
(autocast, GradScaler, TF32), cache emptying and torch.compile. No torch at module level:
`apply_allocator_env` must run before torch is first imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuopt.core.spec import CacheConf, CompileConf, PrecisionConf

if TYPE_CHECKING:
    import torch

# PyTorch reads the caching allocator's settings from these once, when CUDA initialises; newer
# releases read PYTORCH_ALLOC_CONF and still honour the older CUDA-specific name.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# The CPU allocator's transparent-huge-pages switch, read when torch is imported.
THP_VAR = "THP_MEM_ALLOC_ENABLE"


def apply_allocator_env(cuda_alloc_conf: str | None, cpu_thp: bool) -> list[str]:
    """Put the allocator settings into os.environ; once torch is imported they cannot apply, and
    the returned warnings say so where they differ, so results are never mislabelled."""
    if "torch" not in sys.modules:
        if cuda_alloc_conf:
            os.environ.update({name: str(cuda_alloc_conf) for name in ALLOC_CONF_VARS})
        if cpu_thp:
            os.environ[THP_VAR] = "1"
        return []
    unapplied = []
    if cuda_alloc_conf and os.environ.get(ALLOC_CONF_VARS[1]) != cuda_alloc_conf:
        unapplied.append((f"cache.cuda_alloc_conf={cuda_alloc_conf!r}", ALLOC_CONF_VARS[1]))
    if cpu_thp != (os.environ.get(THP_VAR) == "1"):
        unapplied.append((f"cache.cpu_thp={str(cpu_thp).lower()}", THP_VAR))
    return [
        f"{setting} did not apply: torch was already imported in this process with "
        f"{var}={os.environ.get(var)!r}; run trials in fresh processes "
        "(hydra/launcher=fresh_process)"
        for setting, var in unapplied
    ]


_default_threads: int | None = None


def set_num_threads(num_threads: int | None) -> None:
    """torch.set_num_threads for this trial; None restores PyTorch's default (an earlier trial in
    the process may have changed it)."""
    import torch

    global _default_threads
    if _default_threads is None:
        _default_threads = torch.get_num_threads()
    torch.set_num_threads(int(num_threads) if num_threads is not None else _default_threads)


@dataclass
class PrecisionPolicy:
    """How the step runs numerically: the autocast dtype (None: no autocast) and a GradScaler."""

    device_type: str
    autocast_dtype: torch.dtype | None
    scaler: Any  # torch.amp.GradScaler | None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)


def precision_policy(conf: PrecisionConf, device: torch.device) -> PrecisionPolicy:
    """Set the process-wide float32 matmul precision and return the autocast/scaler policy."""
    import torch

    # fp32: TF32 tensor-core math off, so "fp32" means fp32 on Ampere+ GPUs too (PyTorch's
    # default for matmul, but cuDNN convolutions default to TF32 allowed).
    tf32 = conf.mode == "tf32"
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(conf.mode)
    scaler = None
    if conf.mode == "fp16":
        # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs none.
        scaler = torch.amp.GradScaler(device.type)
    return PrecisionPolicy(device.type, dtype, scaler)


def empty_device_cache(device: torch.device) -> None:
    """Return cached, unused blocks of the device's caching allocator to the driver."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


@dataclass
class CachePolicy:
    """When to empty the allocator cache (`cache.empty_cache`), and cuDNN autotuning."""

    conf: CacheConf
    device: torch.device

    def apply(self) -> None:
        import torch

        torch.backends.cudnn.benchmark = bool(self.conf.cudnn_benchmark)

    def after_step(self, step: int) -> None:
        if self.conf.empty_cache == "every_n_steps" and (step + 1) % self.conf.every_n_steps == 0:
            empty_device_cache(self.device)

    def at_trial_end(self) -> None:
        if self.conf.empty_cache in ("trial_end", "every_n_steps"):
            empty_device_cache(self.device)


def compile_function(fn: Callable[..., Any], conf: CompileConf) -> Callable[..., Any]:
    """Wrap `fn` in torch.compile (lazy: compilation happens on the first call)."""
    if conf.mode == "off":
        return fn
    import torch

    return torch.compile(fn, mode=conf.mode, fullgraph=conf.fullgraph, dynamic=conf.dynamic)
