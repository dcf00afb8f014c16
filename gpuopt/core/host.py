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


def proc_stat(pid: int | str) -> list[str]:
    """/proc/<pid>/stat's fields after comm (which may hold spaces and parentheses); [] without."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def child_pids() -> list[str] | None:
    """This process's live children, from /proc (Linux): a DataLoader's workers are such children.
    None elsewhere."""
    pid = os.getpid()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: list[str] = []
    for tid in tasks:
        try:
            out += Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue  # the thread ended, or the kernel lacks CONFIG_PROC_CHILDREN
    return out


def children_cpu_ticks() -> int | None:
    """CPU time (user + system, clock ticks) of this process's live children; None where /proc is
    absent."""
    children = child_pids()
    if children is None:
        return None
    total = 0
    for child in children:
        fields = proc_stat(child)  # [] where the child ended meanwhile
        if fields:
            total += int(fields[11]) + int(fields[12])  # utime, stime (proc(5) fields 14, 15)
    return total


def wait_for_idle_children(max_s: float = 2.0, quiet_s: float = 0.05) -> float:
    """Wait (at most `max_s`) until this process's children used no CPU for `quiet_s`; the seconds
    waited. Why: configurations sharing a process each keep DataLoader workers; once one's window
    ends, its workers refill their prefetch queues, and doing so inside the next configuration's
    window would charge it for the other's loading (the in-process baseline read slow beside a
    candidate with workers). Where /proc is absent this returns at once."""
    import time

    if not child_pids():  # no loader workers (or no /proc): nothing to wait for
        return 0.0
    started = time.monotonic()
    last, last_change = children_cpu_ticks(), started
    while time.monotonic() - started < max_s:
        time.sleep(0.01)
        ticks = children_cpu_ticks()
        if ticks is None:
            break
        if ticks != last:
            last, last_change = ticks, time.monotonic()
        elif time.monotonic() - last_change >= quiet_s:
            break
    return time.monotonic() - started
