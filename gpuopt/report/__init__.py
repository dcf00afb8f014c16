"""Review a study: `python -m gpuopt.report` (see docs/report.md).

Reads what the gpuopt sweeper stored in an Optuna storage and shows the hardware, trial counts,
baseline vs best with the speedup, the Pareto front, the change to apply, bottleneck diagnoses,
parameter importances and plots; exports the best configuration as a Hydra experiment config.
"""

from gpuopt.report.storage import ReportError, default_storage_url, load_study, open_storage
from gpuopt.report.summary import StudyReport, TrialView, build_report

__all__ = [
    "ReportError",
    "StudyReport",
    "TrialView",
    "build_report",
    "default_storage_url",
    "load_study",
    "open_storage",
]
