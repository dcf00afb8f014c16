"""Whether the kernel's OOM killer ended a trial process, on evidence only.

SIGKILL has many senders (Lightning's DDP launcher SIGKILLs its main process when a rank exits
non-zero, a watchdog, `kill -9`), so a trial's reason names the OOM killer only when the memory
cgroup's OOM-kill count rose while it ran (v2 `memory.events`, counted for the victim's cgroup and
its parents, also for a host-wide kill; v1 `memory.oom_control`), or the kernel log (`dmesg`, where
readable) has an OOM kill of the trial's process. Torch-free, stdlib only.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_COUNT = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)
_KILLED = re.compile(r"(?:Killed process |oom-kill:.*\bpid=)(\d+)")


def _cgroup_files(root: Path = CGROUP_ROOT) -> list[Path]:
    """Where this process's memory cgroup keeps its OOM-kill count, most specific first."""
    found: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2
            found += [root / rel / "memory.events", root / "memory.events"]
        elif "memory" in controllers.split(","):  # cgroup v1
            found += [root / "memory" / rel / "memory.oom_control"]
            found += [root / "memory" / "memory.oom_control"]
    return found


def _count(files: Iterable[Path]) -> tuple[Path | None, int | None]:
    for path in files:
        try:
            match = _COUNT.search(path.read_text())
        except OSError:
            continue
        if match is not None:
            return path, int(match.group(1))
    return None, None


@dataclass(frozen=True)
class OomWatch:
    """The memory cgroup's OOM-kill count when a trial started (None: no cgroup file to read)."""

    path: Path | None
    count: int | None

    @classmethod
    def start(cls) -> OomWatch:
        return cls(*_count(_cgroup_files()))

    def evidence(self, pids: Iterable[int] = ()) -> str | None:
        """What says the OOM killer struck since `start` (None: nothing does)."""
        if self.path is not None and self.count is not None:
            _, now = _count([self.path])
            if now is not None and now > self.count:
                return f"{self.path} oom_kill {self.count} -> {now}"
        wanted = {int(pid) for pid in pids if pid}
        if wanted:
            for line in _kernel_log():
                match = _KILLED.search(line)
                if match is not None and int(match.group(1)) in wanted:
                    return f"the kernel log: {line.strip()}"
        return None


def _kernel_log() -> list[str]:
    """The kernel's ring buffer, where this user may read it (dmesg_restrict), else nothing."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.splitlines()[-2000:] if out.returncode == 0 else []
