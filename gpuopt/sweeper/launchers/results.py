"""What the sweeper gets back for one trial job, from either launcher (fresh_process, slurm).

A job that returned is its own `JobReturn` (read from submitit's result pickle; task 0's in a job
of several tasks, each one rank). A job that ended without one (a segfault, os.abort(), the
kernel's OOM killer, a timeout, SLURM's verdict) becomes a `JobReturn` with status FAILED holding a
`TrialProcessError`, whose message is the whole reason, or, where one of its ranks wrote its
failure first, a COMPLETED one holding that rank's failure (gpuopt.core.rank_files);
the sweeper records it like any failing task and the other jobs of the batch keep their results.
Either way the return carries `gpuopt_diagnostics` (`TrialDiagnostics`): the job's logs, its run
dir and its traceback, stored on the trial by gpuopt.sweeper.record.

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

# What a failed trial keeps of its stderr log: the head (the first error, "Fatal Python error: ...")
# and the tail (the last frames), with a marker saying how much was cut in between.
LOG_HEAD_CHARS = 2000
LOG_TAIL_CHARS = 4000


class TrialProcessError(RuntimeError):
    """A trial process that ended without a result: killed by a signal, exited, or timed out.

    Its message is the whole reason (no exception-type prefix in the trial's user attrs); `log_tail`
    holds the head and the tail of the job's stderr log (a segfault's "Fatal Python error" and the
    user's frame are near the start, the last frames at the end), `log_path` the whole log.
    """

    def __init__(self, reason: str, log_tail: str = "", log_path: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.log_tail = log_tail  # head and tail of the log (log_excerpt), secrets masked
        self.log_path = log_path  # the whole log


def describe_exit(code: int | None, oom_evidence: str | None = None) -> str:
    """A trial process's exit status in words. A SIGKILL is the kernel's OOM killer's only with
    `oom_evidence` (gpuopt.sweeper.launchers.oom_evidence: the cgroup's OOM-kill count rose, or
    the kernel log names the process); SIGKILL has other senders (a launcher ending a failed
    job's processes, a watchdog, `kill -9`)."""
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


def excerpt(text: str, head: int = LOG_HEAD_CHARS, tail: int = LOG_TAIL_CHARS) -> str:
    """The first `head` and last `tail` characters of `text`, the cut marked; all of a short one."""
    if len(text) <= head + tail:
        return text
    return f"{text[:head]}\n[... {len(text) - head - tail} chars cut ...]\n{text[-tail:]}"


def log_excerpt(path: Path) -> str:
    """Head and tail of a log (`excerpt`), secrets masked."""
    try:
        with open(path, "rb") as f:
            return excerpt(mask_secrets(f.read().decode(errors="replace")))
    except OSError:
        return ""


def log_tail(path: Path, chars: int = 2000) -> str:
    """The last `chars` characters of a log, secrets masked ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return mask_secrets(f.read().decode(errors="replace"))
    except OSError:
        return ""


def fatal_error(path: Path) -> str | None:
    """The native crash a process's log names: faulthandler's "Fatal Python error: X" and the
    innermost frame it printed ("in torch/_ops.py, line 875 in __call__"), or None. A process
    that torch aborted in a kernel says so in the trial's reason, not only in its log."""
    text = log_tail(path, 20000)
    index = text.rfind("Fatal Python error:")
    if index < 0:
        return None
    lines = text[index:].splitlines()
    frame = next((ln.strip() for ln in lines[1:] if ln.strip().startswith("File ")), None)
    return f"{lines[0].strip()}" + (f" ({frame})" if frame else "")


@dataclass(frozen=True)
class TrialDiagnostics:
    """Where to look when a trial failed, attached to its JobReturn (`gpuopt_diagnostics`) and
    stored by gpuopt.sweeper.record: the job's full logs, its run dir, and its traceback (head and
    tail): the one formatted in the trial process, else the last one in its logs (a gpuopt trial
    that caught the error logs it), else the head and tail of the stderr log (a crash)."""

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
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    index = text.rfind("Traceback (most recent call last)")
    return excerpt(mask_secrets(text[index:])) if index >= 0 else None


def attach_diagnostics(ret: JobReturn, job: Any, run_dir: str | None) -> None:
    """Set `ret.gpuopt_diagnostics` from the job's logs (`run_dir`: where the job's output dir is
    when the trial died before it could report it)."""
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
        # A job of several tasks is one rank per task: task 0 holds rank 0's return (read alone:
        # `results()` would wait for every task, also one that SLURM ended without a result).
        ret = (job.task(0) if getattr(job, "num_tasks", 1) > 1 else job).results()[0]
        if isinstance(ret, JobReturn):
            return ret
        raise TypeError(f"the job returned {type(ret).__name__}, not a JobReturn")
    except Exception as exc:
        return failed_return(overrides, exc)


def completed_return(overrides: list[str], value: Any) -> JobReturn:
    """A COMPLETED JobReturn holding `value`, as if the task had returned it (a trial process
    killed after one of its ranks wrote its failure: that failure is the trial's result)."""
    ret = JobReturn(overrides=overrides, status=JobStatus.COMPLETED)
    ret.return_value = value
    return ret


def failed_return(overrides: list[str], exc: BaseException) -> JobReturn:
    """A FAILED JobReturn holding `exc`; a TrialProcessError's log excerpt is its traceback."""
    ret = JobReturn(overrides=overrides, status=JobStatus.FAILED)
    ret.return_value = exc
    if isinstance(exc, TrialProcessError) and exc.log_tail:
        ret.gpuopt_traceback = exc.log_tail  # type: ignore[attr-defined]  (a crash: its log)
    return ret
