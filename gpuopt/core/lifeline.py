"""A trial ends when its sweep ends, however it ended, and by its own deadline; and whether a
process still runs (`process_alive`: the one liveness check, of a trial's sweep here and of a
trial's owner when a study is resumed, gpuopt.sweeper.resume).

The real process tree of a trial (hydra/launcher=fresh_process):

    sweep -> /bin/sh -c "<setup lines> && python -m gpuopt.sweeper.launchers._controller"   (own session)
                 -> submitit's controller -> trial (python -m submitit.core._submit)
                                                -> DataLoader workers

The launcher starts the shell in a session of its own, so that a timeout kills the whole tree with
one `killpg`; but then no signal of the sweep's reaches the trial either. A sweep killed with
SIGKILL, or by a closed terminal (SIGHUP), left its trial running, unwatched: nobody enforced its
timeout, and the resumed sweep re-ran it beside it (on a GPU, both hold the device).

`guard_trial`, called in the trial process before the task runs:
- `prctl(PR_SET_PDEATHSIG, SIGKILL)` (Linux): the kernel kills the trial when its parent, the
  controller, dies;
- a watchdog thread, because the controller is not the sweep (the shell and the controller survive
  the sweep): every `POLL_S` it checks that the sweeping process still runs (its pid and start
  time, so a reused pid is not taken for it) and that the trial is within its own `timeout_s`.
  Either check failing writes one line into the trial's stderr log and SIGKILLs the job's process
  group (shell, controller, trial, DataLoader workers).

On the sweep's side, `terminate_as_interrupt`: while trials run, SIGTERM and SIGHUP end the sweep
as Ctrl-C does, so its launcher kills the trials and the sweep marks them interrupted.

Light: stdlib only (it runs in every trial process).
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
from pathlib import Path
from typing import Any

POLL_S = 0.5
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The line the watchdog writes into the trial's stderr log before it kills the trial; the launcher
# reads the reason back from it (the job then has no result and no exit code of its own).
MARKER = "gpuopt watchdog: "


def start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    try:
        return int(fields[19])  # field 22 overall: starttime
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start: int | None) -> bool:
    """Whether `pid` still runs and is the process that started at `start` (None: any start).

    A zombie (exited, not yet reaped by its parent) is dead, though kill(pid, 0) still finds it;
    a pid now held by a process that started at another time is dead too (the pid was reused).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the kill(0) answer is all there is
    if state == "Z":
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


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
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
    """While trials run, SIGTERM (kill, a scheduler's stop) and SIGHUP (a closed terminal) raise
    KeyboardInterrupt like Ctrl-C, so the launcher can kill its trials before the sweep exits and
    the sweep can mark them interrupted. Main thread only (Python's rule)."""
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
