"""What the sweeper gets back for one trial job, from either launcher (fresh_process, slurm).

A job that ended without a result (a segfault, the OOM killer, a timeout, SLURM's verdict) becomes
a FAILED `JobReturn` holding a `TrialProcessError`, so the other jobs of the batch keep theirs.
Hydra imports the launchers on every run (plugin discovery): hydra only here, no submitit.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus

from gpuopt.core.secrets import mask_secrets


class TrialProcessError(RuntimeError):
    """A trial process that ended without a result; its message is the whole reason, `log_tail`
    the head and tail of its stderr (a segfault's "Fatal Python error" and the user's frame are
    near the start, the last frames at the end)."""

    def __init__(self, reason: str, log_tail: str = "") -> None:
        super().__init__(reason)
        self.log_tail = log_tail


def describe_exit(code: int | None, oom_evidence: str | None = None) -> str:
    """A trial process's exit status in words. SIGKILL names the OOM killer only with
    `oom_evidence` (oom_evidence.py): it has other senders (a launcher, a watchdog, `kill -9`)."""
    if code is None:
        return "ended without an exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"killed by signal {name}"
        if name == "SIGKILL" and oom_evidence:
            text += f" by the kernel's OOM killer ({oom_evidence})"
        return text
    return f"exited with code {code} without a result"


def excerpt(text: str, head: int = 2000, tail: int = 4000) -> str:
    """The first `head` and last `tail` characters of `text` (the first error and the last
    frames), the cut marked; all of a short one."""
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n[... {len(text) - head - tail} chars cut ...]\n{text[-tail:]}"


def log_excerpt(path: Path) -> str:
    """Head and tail of a log (`excerpt`), secrets masked."""
    return excerpt(log_tail(path, None))


def log_tail(path: Path, chars: int | None = 2000) -> str:
    """The last `chars` characters of a log (None: all of it), secrets masked ("" when it cannot
    be read)."""
    try:
        with open(path, "rb") as f:
            if chars is not None:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
            return mask_secrets(f.read().decode(errors="replace"))
    except OSError:
        return ""


def fatal_error(path: Path) -> str | None:
    """faulthandler's "Fatal Python error: X" in a log, with the innermost frame it printed, or
    None: a process torch aborted in a kernel says so in the trial's reason, not only in its log."""
    text = log_tail(path, 20000)
    index = text.rfind("Fatal Python error:")
    if index < 0:
        return None
    lines = text[index:].splitlines()
    frame = next((ln.strip() for ln in lines[1:] if ln.strip().startswith("File ")), None)
    return f"{lines[0].strip()}" + (f" ({frame})" if frame else "")


@dataclass(frozen=True)
class TrialDiagnostics:
    """Where to look when a trial failed (`ret.gpuopt_diagnostics`, stored by sweeper/record): the
    job's logs, its run dir, its traceback (the trial's own, else the last in its logs)."""

    logs: list[str]
    run_dir: str | None
    traceback: str | None


def with_traceback(ret: JobReturn) -> JobReturn:
    """In the trial process: a failed job's traceback as text (pickling drops its frames)."""
    import traceback

    if ret.status is JobStatus.FAILED:
        try:
            ret.return_value  # noqa: B018  (raises the task's exception)
        except BaseException as exc:
            text = "".join(traceback.format_exception(exc))
            ret.gpuopt_traceback = excerpt(mask_secrets(text))  # type: ignore[attr-defined]
    return ret


def _last_traceback(path: Path) -> str | None:
    text = log_tail(path, None)
    index = text.rfind("Traceback (most recent call last)")
    return excerpt(text[index:]) if index >= 0 else None


def attach_diagnostics(ret: JobReturn, job: Any, run_dir: str | None) -> None:
    """Set `ret.gpuopt_diagnostics` (`run_dir`: for a trial that died before reporting its own)."""
    traceback = (
        getattr(ret, "gpuopt_traceback", None)
        or _last_traceback(job.paths.stdout)
        or _last_traceback(job.paths.stderr)
    )
    ret_dir = getattr(getattr(getattr(ret, "hydra_cfg", None), "hydra", None), "runtime", None)
    ret.gpuopt_diagnostics = TrialDiagnostics(  # type: ignore[attr-defined]
        logs=[str(job.paths.stdout), str(job.paths.stderr)],
        run_dir=str(ret_dir.output_dir) if ret_dir is not None else run_dir,
        traceback=traceback,
    )


def job_return(job: Any, overrides: list[str]) -> JobReturn:
    """The job's JobReturn from its result pickle; a failed one if submitit itself failed."""
    try:
        # Several tasks are one rank each: task 0's return read alone (`results()` would wait for
        # every task, also one that SLURM ended without a result).
        ret = (job.task(0) if getattr(job, "num_tasks", 1) > 1 else job).results()[0]
        if isinstance(ret, JobReturn):
            return ret
        raise TypeError(f"the job returned {type(ret).__name__}, not a JobReturn")
    except Exception as exc:
        return failed_return(overrides, exc)


def failed_return(overrides: list[str], exc: BaseException) -> JobReturn:
    """A FAILED JobReturn holding `exc`; a TrialProcessError's log excerpt is its traceback."""
    ret = JobReturn(overrides=overrides, status=JobStatus.FAILED)
    ret.return_value = exc
    if isinstance(exc, TrialProcessError) and exc.log_tail:
        ret.gpuopt_traceback = exc.log_tail  # type: ignore[attr-defined]
    return ret
