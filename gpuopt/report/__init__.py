"""Review a study the gpuopt sweeper stored: `python -m gpuopt.report` (see docs/report.md)."""

from gpuopt.report.build import StudyReport, TrialView, build_report
from gpuopt.report.report_error import ReportError

__all__ = [
    "ReportError",
    "StudyReport",
    "TrialView",
    "build_report",
]
