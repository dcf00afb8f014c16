"""Configurations a library bug would crash, refused before they run: a native crash cannot be
caught and would end the trial's (possibly shared) process, so the trial ends first with a reason
naming the bug and the setting that avoids it.

Known here:
- oneDNN's AVX2 1x1 convolution, backward by weights (`jit_1x1:avx2`, torch 2.13 CPU), on
  channels_last inputs with 2-7 input channels at stride > 1: torch aborts, segfaults or spins
  ("Fatal Python error: Aborted" in `convolution_backward`). Measured 2026-12-04 on a 2-core AMD
  EPYC with oneDNN capped at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`): 5-8 crashes in 8 runs for in
  channels 2, 4, 6 (1x1, stride 2 and 3, 1 and 2 threads); none at 8, 12, 20 in channels, at
  stride 1, with a 3x3 kernel, in NCHW, or under bf16/fp16 autocast. CPUs with AVX-512 run
  another kernel (`brgconv`) and never crashed.
"""

from __future__ import annotations

import os

import torch

# ONEDNN_MAX_CPU_ISA values at or above AVX-512 (oneDNN's `dnnl_cpu_isa_t` names); any other value
# caps oneDNN below it, as a CPU without AVX-512 does.
_AVX512_ISAS = ("AVX512", "AVX10", "ALL", "DEFAULT")
_SMALLEST_SAFE_IN_CHANNELS = 8  # one AVX2 register of fp32: the kernel's channel block


class KnownLibraryBug(RuntimeError):
    """A configuration a known library bug would crash on this machine (never run)."""


def onednn_below_avx512() -> bool:
    """Whether oneDNN runs its AVX2 (or older) kernels here: no AVX-512 on this CPU, or oneDNN
    capped below it by ONEDNN_MAX_CPU_ISA."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and not cap.startswith(_AVX512_ISAS):
        return True
    return not torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def crashing_convolutions(model: torch.nn.Module) -> list[str]:
    """The convolutions of `model` the bug crashes on: 1x1, stride > 1, 2-7 input channels per
    group, weights trained."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Conv2d) or not module.weight.requires_grad:
            continue
        in_per_group = module.in_channels // module.groups
        if (
            tuple(module.kernel_size) == (1, 1)
            and max(module.stride) > 1
            and 1 < in_per_group < _SMALLEST_SAFE_IN_CHANNELS
        ):
            found.append(f"{name or 'model'} ({module.in_channels}->{module.out_channels})")
    return found


def check_channels_last(model: torch.nn.Module, device: torch.device, precision: str) -> None:
    """Raise KnownLibraryBug where `model` in channels_last would crash torch on this CPU (fp32:
    autocast runs these convolutions in bf16/fp16 kernels that do not crash)."""
    if device.type != "cpu" or precision != "fp32" or not onednn_below_avx512():
        return
    convolutions = crashing_convolutions(model)
    if convolutions:
        raise KnownLibraryBug(
            "model.channels_last=true would crash torch here: oneDNN's AVX2 1x1 convolution "
            "(backward by weights) aborts on channels_last with 2-7 input channels at stride > 1 "
            f"({', '.join(convolutions[:3])}); this CPU runs oneDNN without AVX-512. "
            "Use model.channels_last=false on this machine, or a precision of bf16/fp16."
        )
