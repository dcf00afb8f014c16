"""Review a study: `python -m gpuopt.report` (see docs/report.md).

Reads what the gpuopt sweeper stored in an Optuna storage and shows the hardware, trial counts,
baseline vs best with the speedup, the Pareto front, the change to apply, bottleneck diagnoses,
parameter importances and plots; exports the best configuration as a Hydra experiment config.
Finding and opening the storage is gpuopt.study.storage's (shared with the sweeper).
"""

from gpuopt.report.build import StudyReport, TrialView, build_report
from gpuopt.report.report_error import ReportError

__all__ = [
    "ReportError",
    "StudyReport",
    "TrialView",
    "build_report",
]
