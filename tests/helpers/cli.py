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
    return subprocess.run(
        [sys.executable, "-m", "gpuopt.run", *overrides],
        cwd=REPO,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def run_cli_forked(cli_forks, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """`run_cli` for a run that ends before its trial (bad input): the same command, directory and
    environment, in a process forked from one with the CLI's torch-free modules imported
    (tests/helpers/forked_cli.py, the `cli_forks` fixture)."""
    return cli_forks.run("gpuopt.run", overrides, REPO, _env(tmp_path))


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "GPUOPT_OUTPUT_DIR": str(tmp_path / "outputs"), "COLUMNS": "250"}
