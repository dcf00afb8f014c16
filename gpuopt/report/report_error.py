"""The report's one error: a problem the user can fix, shown as one line (`gpuopt.report: error:
...`, exit 2), never a traceback. A missing storage or study is gpuopt.study.storage's
`StorageError`, shown the same way."""

from __future__ import annotations


class ReportError(Exception):
    """A problem the user can fix (no trial to export, an unknown trial, an unreadable
    result.json): a message, not a traceback."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
