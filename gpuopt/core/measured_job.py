"""How an app's own job hands a measuring callback's result to the sweeper, whatever its task
returns: `gpuopt_measured.json` in the job's run directory. In a sweep's trial the callback then
raises `TrialMeasured`, ending the job there (no rest of the fit, no validation per trial); a
BaseException, so that the app's own `except Exception` (lightning-hydra-template's
`task_wrapper`) lets it through. Torch-free.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from numbers import Real
from pathlib import Path
from typing import Any

from gpuopt.core.rank_files import TRIAL_PID_ENV
from gpuopt.core.result import TrialResult

MEASURED_FILE = "gpuopt_measured.json"
log = logging.getLogger("gpuopt")
# What runs when the job's task returned, before the trial reads the file: a measuring hook's
# "ended unmeasured" status (gpuopt.MeasureJob), which Hydra's on_job_end would write too late.
_task_end: list[Callable[[], Any]] = []
_ranks_started: list[bool] = [False]  # this process started the job's ranks: they measure it


def mark_ranks_started() -> None:
    """This trial's process only starts and waits for the job's ranks: its own measuring hooks,
    which see no training, leave the job's status to the ranks."""
    _ranks_started[0] = True


def ranks_started() -> bool:
    return _ranks_started[0]


class TrialMeasured(BaseException):
    """The job was measured in a sweep's trial: its result is written; the job ends here."""


def in_sweep_trial() -> bool:
    """Whether this process runs a trial of a gpuopt sweep (its trial task set $GPUOPT_TRIAL_PID)."""
    return bool(os.environ.get(TRIAL_PID_ENV))


def single_run() -> bool:
    """Whether this process runs one job on its own: Hydra's RUN mode, or no Hydra job at all (a
    multirun's process may run the next job)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return True
    return not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN


def write(result: TrialResult, run_dir: Path | None = None) -> Path | None:
    """Save `result` in the job's run directory (None outside a Hydra job), with the search space
    found in it where the result says what the training ran with (a single run logs it)."""
    from hydra.core.hydra_config import HydraConfig

    from gpuopt.core.search_space import SEARCH_SPACE_FILE, write_proposal

    folder = run_dir
    if folder is None and HydraConfig.initialized():
        folder = Path(str(HydraConfig.get().runtime.output_dir))
    if folder is None:
        return None
    path = folder / MEASURED_FILE
    result.save(path)
    observed = result.config.get("observed")
    if isinstance(observed, dict):
        proposal = write_proposal(
            folder, observed, str(result.env.get("device", "cpu")).split(":")[0]
        )
        if proposal and not in_sweep_trial():
            log.info("gpuopt: the search space found in this run (%s):\n%s",
                     folder / SEARCH_SPACE_FILE, proposal)  # fmt: skip
    return path


def at_task_end(hook: Callable[[], Any]) -> None:
    _task_end.append(hook)


def task_ended() -> None:
    """Run (once) what was registered to run when the job's task returned."""
    while _task_end:
        _task_end.pop()()


def read(run_dir: Path) -> TrialResult | None:
    path = run_dir / MEASURED_FILE
    return TrialResult.load(path) if path.is_file() else None


def is_gpuopts_result(value: Any) -> bool:
    """Whether a task returned gpuopt's result itself: a TrialResult, its dict, or a dict of named
    metrics with one of gpuopt's (the stock contract)."""
    from gpuopt.core.metrics import goals

    if isinstance(value, TrialResult):
        return True
    return isinstance(value, dict) and ("metrics" in value or any(k in goals() for k in value))


def with_app_return(result: TrialResult, value: Any) -> TrialResult:
    """`result` with the app's own return kept: a number as {"value": x}, a dict's scalars."""
    if isinstance(value, Real) and not isinstance(value, bool):
        kept = {"value": float(value)}
    elif isinstance(value, dict):
        kept = {str(k): v for k, v in value.items() if isinstance(v, (int, float, str, bool))}
    else:
        kept = {}
    kept = {k: v for k, v in kept.items() if not (isinstance(v, float) and math.isnan(v))}
    result.app_return = kept or None
    return result
