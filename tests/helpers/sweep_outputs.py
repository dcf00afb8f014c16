"""The identity of a sweep for `gpuopt.sweeper.outputs.write_outputs` on an in-memory study
(tests/test_lifecycle.py, tests/test_race.py): what the summary and files are written from."""

from __future__ import annotations

from pathlib import Path

from gpuopt.sweeper.open_study import SweepIdentity


def sweep_identity(sweep_dir: Path, *names: str) -> SweepIdentity:
    """gpuopt's own task in `sweep_dir`, its objectives `names` (throughput by default) maximized."""
    metrics = list(names) or ["throughput"]
    return SweepIdentity(
        study_name="s",
        storage="memory",
        sweep_dir=sweep_dir,
        names=metrics,
        directions=["maximize"] * len(metrics),
        app_command="python -m gpuopt.run",
        groups=[],
    )
