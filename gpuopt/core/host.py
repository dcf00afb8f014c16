"""Facts about the host machine that need no torch (the sweeping process never imports it)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def usable_cpus() -> int:
    """CPUs this process may run on (affinity aware; cgroup CPU quotas are not counted)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# Fields of /proc/stat's "cpu" line, in order (proc(5)); guest time is already in user.
_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_ticks() -> dict[str, int] | None:
    """The machine's CPU time so far by kind, in clock ticks (/proc/stat, Linux); None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 1 + len(_STAT_FIELDS):
        return None
    return dict(zip(_STAT_FIELDS, map(int, fields[1:]), strict=False))


def steal_percent(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
    """The share of all CPU time between two `cpu_ticks` readings that the hypervisor gave to
    other guests ("steal"), in %: time this VM's vCPUs wanted to run and could not. Load averages
    do not show it, and it slows every measurement in that span. None when unknown."""
    if before is None or after is None:
        return None
    total = sum(after.values()) - sum(before.values())
    if total <= 0:
        return None
    return 100.0 * (after["steal"] - before["steal"]) / total
