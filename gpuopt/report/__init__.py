"""Review a study the gpuopt sweeper stored: `python -m gpuopt.report` (see docs/report.md)."""

from gpuopt.report.build import ReportError, StudyReport, TrialView, build_report

__all__ = [
    "ReportError",
    "StudyReport",
    "TrialView",
    "build_report",
]
