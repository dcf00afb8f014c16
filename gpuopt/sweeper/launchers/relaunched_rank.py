"""A rank that the user's own training re-launched from a trial (Lightning's DDP launcher running
`python <sys.argv[0]> <sys.argv[1:]> hydra.run.dir=...`, the trial having presented this file and
the script: trial_task.single_run):

    python .../relaunched_rank.py --gpuopt-script /abs/train.py -- [config options] [overrides]

It runs the script as `python train.py ...` would, and first: ends with the trial (parent-death
signal), sends its output to the trial's `ranks/rank_N.*.log`, and writes its failure before it
exits (`ranks/rank_N.json`; HYDRA_FULL_ERROR so the exception itself, not Hydra's one-line report,
reaches it): Lightning then kills the trial, whose reason is still this rank's own error.

Run as a file, so Python put this folder first on `sys.path`: undone before anything is imported.
"""

import os
import sys

if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # not gpuopt/sweeper/launchers/: its modules would shadow the user's

import runpy
import time
from pathlib import Path

from gpuopt.core import rank_files
from gpuopt.core.lifeline import set_parent_death_signal
from gpuopt.core.result import Status, TrialResult


def _split(argv: list[str]) -> tuple[str, str, list[str]]:
    """(`--gpuopt-script` | `--gpuopt-module`, its value, the script's own arguments)."""
    if len(argv) < 2 or argv[0] not in ("--gpuopt-script", "--gpuopt-module"):
        raise SystemExit(f"usage: {Path(__file__).name} --gpuopt-script PATH -- [args...]")
    rest = argv[2:]
    return argv[0], argv[1], rest[1:] if rest[:1] == ["--"] else rest


def _redirect(folder: Path | None, rank: int) -> None:
    """This process's stdout and stderr into the trial's ranks/ folder."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        target = os.open(folder / f"rank_{rank}.{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)


def _record(folder: Path | None, rank: int, reason: str) -> None:
    """This rank's failure, unless gpuopt's measurement already wrote its own (`RankFailed`)."""
    if folder is not None and (folder / rank_files.RESULT_FILE.format(rank=rank)).exists():
        return
    result = TrialResult(status=Status.ERROR, reason=reason)
    result.env["failed_at"] = time.time()
    rank_files.write_rank_result(result, rank)


def main(argv: list[str]) -> None:
    kind, target, args = _split(argv)
    set_parent_death_signal()
    parent = os.environ.get(rank_files.TRIAL_PID_ENV)
    if parent is not None and os.getppid() != int(parent):  # the trial ended before the signal
        os._exit(1)
    rank, folder = rank_files.global_rank(), rank_files.ranks_dir_from_env()
    _redirect(folder, rank)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # the task's exception, not Hydra's one-line report
    try:
        if kind == "--gpuopt-script":
            sys.argv, sys.path[0] = [target, *args], os.path.dirname(target)
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (0, None):
            _record(folder, rank, f"exited with code {exc.code}")
        raise
    except BaseException as exc:
        _record(folder, rank, f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
