"""What the bottleneck rules (gpuopt/report/diagnose.py) read and cite: one trial's measured facts
(`Facts`, None where not recorded), the thresholds, and each rule's evidence lines, citations and
suggestions. Utilization is evidence only on CUDA (NVML's sampled `utilization.gpu`); elsewhere it
is derived from data_wait and says nothing new.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from gpuopt.core import knobs
from gpuopt.core.limits import HighestLimit, higher_elsewhere

# A step that spends this much of the timed window blocked on `next(loader)` is input-bound.
DATA_WAIT_HIGH_PCT = 10.0
# Throughput below this share of the compute-only ceiling (same step, batch already on the device)
# means the input pipeline costs throughput even when the wait is hidden in host-to-device copies.
INPUT_EFFICIENCY_LOW_PCT = 85.0
# NVML utilization below this (with no data wait) means gaps between kernels: host/launch overhead.
UTILIZATION_LOW_PCT = 80.0
# MFU (% of the device's dense peak for the dtype) below this on a busy GPU: memory-bound, or
# kernels too small to fill the device.
MFU_LOW_PCT = 20.0
# MFU at or above this is near what dense training reaches in practice.
MFU_HIGH_PCT = 50.0
# Throughput at or above this share of the machine's limit for the workload (limit_throughput:
# loader and compute costs per sample on the usable cores / the compute ceiling) is at the limit.
LIMIT_HIGH_PCT = 90.0
# Profiled window: GPU idle time that is host wait (% of the window) from which the GPU waits for
# the CPU to launch work: launch-bound.
HOST_WAIT_HIGH_PCT = 20.0
# Profiled window: an optimizer step taking this share of the step is worth fusing.
OPTIMIZER_HIGH_PCT = 15.0
# Profiled window: a host-to-device copy taking this share of the step is worth overlapping.
COPY_HIGH_PCT = 10.0
# The profiled step's phases in the order a step runs them (gpuopt.trial.trace.PHASES), and how
# they read in a verdict.
PHASE_LABELS = {
    "data_wait": "next(loader)",
    "h2d_copy": "host-to-device copy",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "other": "other host time",
}


def attr_number(metrics: Mapping[str, Any], name: str) -> float | None:
    """A stored metric as a number; None when missing, NaN or not a number (bools excluded)."""
    value = metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _is_cuda(device_type: str | None) -> bool:
    return bool(device_type) and str(device_type).startswith("cuda")


@dataclass(frozen=True)
class Facts:
    """What the rules read: one trial's status, device and measured numbers (None: not recorded;
    each `float | None` field is the metric of its name), and its resolved config (for tailored
    suggestions)."""

    status: str
    device_type: str | None
    config: Mapping[str, Any]
    data_wait: float | None = None
    input_efficiency: float | None = None
    utilization: float | None = None
    mfu: float | None = None
    throughput: float | None = None
    ceiling_throughput: float | None = None
    limit_efficiency: float | None = None
    limit_throughput: float | None = None
    limit_bound: str | None = None  # cores | loader | compute (gpuopt.core.limits.Limit.bound)
    # The study's highest limit, where it is clearly above this trial's own (other settings)
    higher_limit: HighestLimit | None = None
    # The profiled window, when the trial was profiled: % of the step by phase, the GPU's time
    # split (% of the window: idle, host_wait, ...) on CUDA.
    phases: Mapping[str, float] | None = None
    gpu: Mapping[str, Any] | None = None
    # A profiled distributed trial: % of the step a collective was in flight, and of that the
    # exposed part (the ranks' mean: gpuopt.trial.trace.comm_time).
    comm_share: float | None = None
    comm_exposed: float | None = None
    # GPM (Hopper and newer; gpuopt.trial.gpm): % of SMs busy, warps resident, tensor pipes busy,
    # DRAM bandwidth; and the dtype the step computed in (`compute_dtype`: fp32, tf32, bf16, fp16).
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    dram_bw_util: float | None = None
    compute_dtype: str | None = None

    @classmethod
    def of(
        cls,
        metrics: Mapping[str, Any],
        status: str,
        device_type: str | None,
        config: Mapping[str, Any],
        highest: HighestLimit | None = None,
    ) -> Facts:
        read: dict[str, Any] = {
            f.name: attr_number(metrics, f.name) for f in fields(cls) if f.type == "float | None"
        }
        if read["data_wait"] is None and not _is_cuda(device_type):
            read["data_wait"] = attr_number(metrics, "host_data_wait")  # off CUDA: the device's
        for name in ("limit_bound", "compute_dtype"):
            read[name] = value if isinstance(value := metrics.get(name), str) else None
        profile = metrics.get("profile")  # gpuopt.trial.profiled_window.ProfileSummary
        profile = profile if isinstance(profile, Mapping) else {}
        phases, gpu = profile.get("phases_pct"), profile.get("gpu")
        return cls(
            status,
            device_type,
            config,
            higher_limit=highest if higher_elsewhere(metrics, highest) else None,
            phases=phases if isinstance(phases, Mapping) and phases else None,
            gpu=gpu if isinstance(gpu, Mapping) else None,
            **read,
        )

    def phase(self, name: str) -> float | None:
        """The phase's % of the profiled step, or None when not profiled."""
        return attr_number(self.phases, name) if self.phases else None

    def gpu_share(self, name: str) -> float | None:
        """A GPU time share (% of the profiled window), or None without a CUDA profile."""
        return attr_number(self.gpu, name) if self.gpu else None

    @property
    def cuda(self) -> bool:
        return _is_cuda(self.device_type)

    def setting(self, dotted: str) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node


# -- the profiled window: what verdicts cite -------------------------------------------------------
def phase_evidence(f: Facts) -> list[str]:
    if not f.phases:
        return []
    shares = ", ".join(
        f"{PHASE_LABELS.get(name, name)} {pct:.0f}%"
        for name, pct in f.phases.items()
        if isinstance(pct, (int, float))
    )
    lines = [f"profiled step: {shares}"]
    idle, host = f.gpu_share("idle"), f.gpu_share("host_wait")
    if idle is not None and host is not None:
        lines.append(
            f"profiled GPU: kernels {f.gpu_share('kernel') or 0:.0f}%, memcpy "
            f"{f.gpu_share('memcpy') or 0:.0f}%, idle {idle:.0f}% ({host:.0f} points host wait, "
            f"{f.gpu_share('kernel_wait') or 0:.0f} kernel wait; launch-bound at >= "
            f"{HOST_WAIT_HIGH_PCT:g} points host wait)"
        )
    if f.comm_share is not None and f.comm_exposed is not None:
        lines.append(
            f"profiled communication: {f.comm_share:.0f}% of the step, {f.comm_exposed:.0f} "
            f"points exposed, {f.comm_share - f.comm_exposed:.0f} overlapped (mean over ranks)"
        )
    return lines


def idle_citation(f: Facts) -> str | None:
    idle, host = f.gpu_share("idle"), f.gpu_share("host_wait")
    if idle is None or host is None:
        return None
    return f"GPU idle {idle:.0f}%, of which {host:.0f} points host wait"


def input_citation(f: Facts) -> str | None:
    wait, copy = f.phase("data_wait"), f.phase("h2d_copy")
    if wait is None:
        return None
    cite = f"{wait:.0f}% of the step in next(loader)"
    return cite + (f", {copy:.0f}% in the host-to-device copy" if copy and copy >= 1 else "")


def largest_phase_citation(f: Facts) -> str | None:
    if not f.phases:
        return None
    name, pct = max(
        ((n, v) for n, v in f.phases.items() if isinstance(v, (int, float))),
        key=lambda item: item[1],
    )
    cite = f"{PHASE_LABELS.get(name, name)} {pct:.0f}% of the step"
    idle = idle_citation(f)
    return f"{cite}; {idle}" if idle else cite


def phase_suggestions(f: Facts) -> list[str]:
    """Tips read off the profiled phases, most specific first."""
    tips = []
    host = f.gpu_share("host_wait")
    if host is not None and host >= HOST_WAIT_HIGH_PCT and uncompiled(f, "default"):
        tips.append(f"{idle_citation(f)}: launch-bound, try {knobs.COMPILE.tip}")
    optimizer = f.phase("optimizer")
    unfused = f.setting(knobs.FUSED.key) is not True
    if optimizer is not None and optimizer >= OPTIMIZER_HIGH_PCT and unfused:
        tips.append(f"optimizer {optimizer:.0f}% of the step: try {knobs.FUSED.tip}")
    copy = f.phase("h2d_copy")
    synchronous = not (f.setting(knobs.PIN_MEMORY.key) and f.setting(knobs.NON_BLOCKING.key))
    if copy is not None and copy >= COPY_HIGH_PCT and f.cuda and synchronous:
        tips.append(f"host-to-device copy {copy:.0f}% of the step: try {knobs.PIN_MEMORY.tip}")
    return tips


def merge_tips(first: list[str], rest: list[str]) -> list[str]:
    """`first`, then the tips of `rest` that do not repeat one of its config overrides."""
    overrides = {word for tip in first for word in tip.split() if "=" in word}
    return first + [tip for tip in rest if not any(o in tip.split() for o in overrides)]


# -- evidence: the numbers behind a verdict, each with the threshold it is read against ----------
def input_evidence(f: Facts) -> list[str]:
    lines = []
    if f.data_wait is not None:
        starved = " (the GPU starved of input)" if f.cuda else ""
        lines.append(
            f"data_wait {f.data_wait:.1f}% of the timed window{starved} "
            f"(input-bound at >= {DATA_WAIT_HIGH_PCT:g}%)"
        )
    if f.input_efficiency is not None:
        vs = (
            f" ({f.throughput:,.0f} vs ceiling {f.ceiling_throughput:,.0f} samples/s)"
            if f.throughput and f.ceiling_throughput
            else ""
        )
        lines.append(
            f"input_efficiency {f.input_efficiency:.1f}%{vs} "
            f"(input-bound at <= {INPUT_EFFICIENCY_LOW_PCT:g}%)"
        )
    return lines


def mfu_text(f: Facts) -> str:
    if f.mfu is None:
        return "MFU unknown (not measured on this device)"
    return f"mfu {f.mfu:.1f}% of peak"


def cpu_evidence(f: Facts) -> list[str]:
    # CPU (or an unknown device): utilization is 100 - data_wait, so it adds no evidence.
    return [*input_evidence(f), mfu_text(f)]


def gpu_evidence(f: Facts) -> list[str]:
    if f.utilization is None:
        utilization = "GPU utilization not recorded"
    else:
        utilization = (
            f"GPU utilization {f.utilization:.1f}% "
            f"(NVML; host-bound below {UTILIZATION_LOW_PCT:g}%)"
        )
    thresholds = (
        f" (low < {MFU_LOW_PCT:g}%, near the limit >= {MFU_HIGH_PCT:g}%)"
        if f.mfu is not None
        else ""
    )
    return [*input_evidence(f), utilization, *gpm_lines(f), mfu_text(f) + thresholds]


GPM_LINES = (
    ("sm_active", "SM activity {:.1f}% (GPM: the share of SMs busy)"),
    ("sm_occupancy", "SM occupancy {:.1f}% (GPM: warps resident / maximum)"),
    ("tensor_active", "tensor-core activity {:.1f}% (GPM: tensor pipes busy)"),
    ("dram_bw_util", "DRAM bandwidth {:.1f}% of the maximum (GPM)"),
)


def gpm_lines(f: Facts) -> list[str]:
    """GPM's numbers where the GPU has it (Hopper and newer): what `utilization` cannot say."""
    return [text.format(v) for name, text in GPM_LINES if (v := getattr(f, name)) is not None]


# -- suggestions: what to try next, as config keys -----------------------------------------------
def input_suggestions(f: Facts) -> list[str]:
    """The suggestions name knobs as the knob catalogue words them (gpuopt.core.knobs, `tip`)."""
    workers = f.setting(knobs.WORKERS.key)
    now = f" (now {workers})" if workers is not None else ""
    tips = [f"more DataLoader workers: {knobs.WORKERS.tip}{now}"]
    if f.cuda and f.setting(knobs.PIN_MEMORY.key) is not True:
        tips.append(f"pinned memory + async copies: {knobs.PIN_MEMORY.tip}")
    if workers and f.setting(knobs.PERSISTENT_WORKERS.key) is not True:
        tips.append(f"keep workers between epochs: {knobs.PERSISTENT_WORKERS.tip}")
    tips.append("cheaper per-sample transforms, or pre-process/cache the dataset once")
    if not f.cuda:
        tips.append(f"on CPU, loader workers share cores with compute: {knobs.THREADS.tip}")
    return tips


def uncompiled(f: Facts, *also: str) -> bool:
    return f.setting(knobs.COMPILE.key) in (None, "off", *also)


def host_suggestions(f: Facts) -> list[str]:
    tips = []
    if uncompiled(f, "default"):
        tips.append(f"fewer kernel launches: {knobs.COMPILE.tip} (torch.compile + CUDA graphs)")
    tips.append(f"more work per launch: {knobs.MICRO_BATCH.tip}")
    if f.setting(knobs.FUSED.key) is not True:
        tips.append(f"fused optimizer step: {knobs.FUSED.tip}")
    return tips


def memory_suggestions(f: Facts) -> list[str]:
    tips = []
    if f.setting(knobs.PRECISION.key) in (None, "fp32", "tf32"):
        tips.append(f"half the bytes per value: {knobs.PRECISION.tip}")
    if f.setting("model.input") == "images" and f.setting(knobs.CHANNELS_LAST.key) is not True:
        tips.append(f"NHWC convolutions: {knobs.CHANNELS_LAST.tip}")
    tips.append(f"bigger kernels: {knobs.MICRO_BATCH.tip}")
    if uncompiled(f):
        tips.append(f"fuse elementwise ops: {knobs.COMPILE.group}=default")
    return tips


# -- the rest of the rules' summaries, evidence and suggestions ------------------------------------
def cpu_compute_summary(f: Facts) -> str:
    where = "CPU" if f.device_type == "cpu" else f"device {f.device_type or 'unknown'}"
    return f"the training step itself limits throughput on {where}; " + (
        "MFU unknown, no finer diagnosis" if f.mfu is None else "no single cause stands out"
    )


def limit_summary(f: Facts) -> str:
    share = f"at {f.limit_efficiency:.0f}% of this machine's limit for this workload"
    if f.higher_limit is not None:
        return (
            f"{share} at its settings; other settings measured a higher limit "
            f"({f.higher_limit.throughput:,.0f} samples/s, trial #{f.higher_limit.trial}): "
            "change the settings first"
        )
    if f.limit_bound == "compute":
        return f"{share} (the compute ceiling): only less math per sample or a faster device help"
    return f"{share}: only cheaper data or more cores help"


def limit_evidence(f: Facts) -> list[str]:
    bound = {
        "cores": "the usable cores shared by the loader's and the compute's cost per sample",
        "loader": "the host cores free to load, at the loader's cost per sample",
        "compute": "the compute ceiling (one batch already on the device)",
    }.get(f.limit_bound or "", "the measured costs per sample")
    lines = [
        f"limit_efficiency {f.limit_efficiency:.1f}% (at the limit >= {LIMIT_HIGH_PCT:g}%)",
        f"limit_throughput {f.limit_throughput:,.0f} samples/s, bound by {bound}"
        if f.limit_throughput
        else f"bound by {bound}",
    ]
    if f.higher_limit is not None:
        lines.append(
            f"limit_throughput {f.higher_limit.throughput:,.0f} samples/s at trial "
            f"#{f.higher_limit.trial}'s settings, the highest in this study"
        )
    return [*lines, *input_evidence(f)]


def limit_suggestions(f: Facts) -> list[str]:
    if f.higher_limit is not None:
        return [
            f"the settings of trial #{f.higher_limit.trial} (batch, workers, threads, precision), "
            "whose limit is higher; its own limit is one noisy measurement, so confirm it"
        ]
    if f.limit_bound == "compute":
        return ["less math per sample: lower precision if not yet, a smaller model, or compile"]
    return [
        "cheaper per-sample transforms, or pre-process/cache the dataset once",
        "more CPU cores for the loader (or a machine with more)",
    ]
