"""The report's one error: a problem the user can fix, shown as one line (`gpuopt.report: error:
...`, exit 2), never a traceback. A missing storage or study is gpuopt.study.storage's
`StorageError`, shown the same way."""


class ReportError(Exception):
    """A problem the user can fix (no trial to export, an unknown trial, an unreadable
    result.json)."""
