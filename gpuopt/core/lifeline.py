"""A trial ends when its sweep ends, however it ended, and by its own deadline; and whether a
process still runs (`process_alive`, also of a trial's owner when a study is resumed).

The launcher starts each trial's shell in a session of its own (a timeout kills the whole tree with
one `killpg`), so no signal of the sweep's reaches the trial: a sweep killed with SIGKILL or SIGHUP
left its trial running, unwatched, and the resumed sweep re-ran it beside it. `guard_trial`, in the
trial process: PR_SET_PDEATHSIG (dies with its parent, the controller) and a watchdog thread, as
the controller outlives the sweep, that checks the sweeping process (pid and start time) and the
trial's own timeout. Stdlib only (it runs in every trial process).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpuopt.core.host import proc_stat

POLL_S = 0.5
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The line the watchdog writes into the trial's stderr log before it kills the trial; the launcher
# reads the reason back from it (the job then has no result and no exit code of its own).
MARKER = "gpuopt watchdog: "


def start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    fields = proc_stat(pid)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None  # starttime


def process_alive(pid: int, start: int | None) -> bool:
    """Whether `pid` still runs and is the process that started at `start` (None: any start): a
    zombie, or a reused pid, is dead though kill(pid, 0) finds it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    fields = proc_stat(pid)
    if not fields:
        return True  # no /proc (not Linux): the kill(0) answer is all there is
    if fields[0] == "Z":
        return False
    current = start_ticks(pid)
    return start is None or current is None or current == start


@dataclass(frozen=True)
class SweepProcess:
    """The sweeping process a trial belongs to (recorded by the launcher, pickled with the job)."""

    pid: int
    start: int | None
    pgid: int  # a trial in this process group (not a session of its own) never kills the group

    @classmethod
    def this(cls) -> SweepProcess:
        pid = os.getpid()
        return cls(pid, start_ticks(pid), os.getpgrp())


def set_parent_death_signal() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watchdog_verdict(sweep: SweepProcess | None, deadline: float, now: float) -> str | None:
    """Why the trial must end now (None: it may go on)."""
    if sweep is not None and not process_alive(sweep.pid, sweep.start):
        return f"the sweeping process {sweep.pid} ended: this trial ends with it"
    if now > deadline:
        return "timed out (hydra.launcher.timeout_s): the trial ended itself"
    return None


def _end_job(reason: str, sweep: SweepProcess | None) -> None:
    """One line into the stderr log, then SIGKILL to the job's process group (this process too)."""
    with contextlib.suppress(OSError):
        os.write(2, f"\n{MARKER}{reason}\n".encode())
    if sweep is not None and os.getpgrp() != sweep.pgid:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)  # not in a group of its own: at least the trial ends


def guard_trial(sweep: SweepProcess | None, timeout_s: float) -> threading.Thread:
    """In the trial process, before the task: parent-death signal and the watchdog thread."""
    set_parent_death_signal()
    deadline = time.monotonic() + timeout_s

    def watch() -> None:
        while True:
            reason = watchdog_verdict(sweep, deadline, time.monotonic())
            if reason is not None:
                if "timed out" in reason:
                    reason = reason.replace("timed out", f"timed out after {timeout_s:g} s", 1)
                _end_job(reason, sweep)
                return
            time.sleep(POLL_S)

    thread = threading.Thread(target=watch, name="gpuopt-lifeline", daemon=True)
    thread.start()
    return thread


def reason_from_log(text: str) -> str | None:
    """The watchdog's reason, when the trial's stderr log ends with its line."""
    index = text.rfind(MARKER)
    if index < 0:
        return None
    return text[index + len(MARKER) :].splitlines()[0].strip() or None


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While trials run, SIGTERM and SIGHUP raise KeyboardInterrupt like Ctrl-C, so the launcher
    kills its trials and the sweep marks them interrupted. Main thread only (Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signals = [signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])]
    previous = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
