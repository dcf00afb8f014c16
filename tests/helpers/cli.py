"""`python -m gpuopt.run` as a user runs it: a subprocess from the repository root, its outputs in
the test's own directory (tests/test_run_cli.py, tests/test_distributed.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(
    tmp_path: Path, *overrides: str, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """One `python -m gpuopt.run` (outputs under tmp_path/outputs), without raising on its exit
    status: the caller asserts it. COLUMNS: rich wraps the table's notes to the terminal's width,
    and a wrapped line is no longer a substring."""
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path / "outputs"), "COLUMNS": "250"}
    return subprocess.run(
        [sys.executable, "-m", "gpuopt.run", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
