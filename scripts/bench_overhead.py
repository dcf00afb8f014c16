"""Sweeper overhead: gpuopt's sweeper vs the stock hydra-optuna-sweeper on the same trivial task.

Both run `python task.py -m` on a task that returns x**2 at once, with the same sampler (the
stock TPE config, `hydra/sweeper/sampler=tpe`, seeded), the same storage kind (an SQLite file),
the same launcher and n_jobs=1, so the difference is what each sweeper does around a trial. A
third row, `gpuopt_tpe`, is gpuopt with its own default sampler (multivariate TPE with
`constant_liar`): what that sampler costs per trial is the sampler's, not the sweeper's. Each runs
with N1 and N2 trials, alternating, `--repeats` times; the per-trial overhead is the slope
(T(N2) - T(N1)) / (N2 - N1) of the median wall times, the fixed cost the rest (process start,
outputs; gpuopt's `python -m gpuopt.env` probe only where a searched key is one it judges: none
here).

    python scripts/bench_overhead.py                       # in-process trials (hydra/launcher=basic)
    python scripts/bench_overhead.py --launcher submitit_local --n1 2 --n2 6 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASK = """
import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def task(cfg: DictConfig) -> float:
    return float(cfg.x) ** 2 + float(cfg.y) ** 2


if __name__ == "__main__":
    task()
"""

CONFIG = """
defaults:
  - override hydra/sweeper: optuna
hydra:
  sweeper:
    direction: minimize
    n_jobs: 1
    sampler:
      seed: 0
    params:
      x: range(-5, 5)
      y: choice(-2, 0, 2)
x: 1
y: 0
"""


# Each row: the sweeper plugin and its sampler (the stock TPE config for both, then gpuopt's own).
ROWS = {
    "optuna": ("optuna", ["hydra/sweeper/sampler=tpe"]),
    "gpuopt": ("gpuopt", ["hydra/sweeper/sampler=tpe"]),
    "gpuopt_tpe": ("gpuopt", []),
}


def run(workdir: Path, row: str, n_trials: int, launcher: str, index: int) -> float:
    sweeper, extra = ROWS[row]
    storage = f"sqlite:///{workdir / f'{row}.db'}"
    cmd = [
        sys.executable,
        "task.py",
        "-m",
        f"hydra/sweeper={sweeper}",
        *extra,
        f"hydra/launcher={launcher}",
        f"hydra.sweeper.n_trials={n_trials}",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweeper.study_name=bench{index}",
        f"hydra.sweep.dir=runs/{sweeper}_{index}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        cwd=workdir,
        capture_output=True,
        text=True,
        env={**os.environ, "GPUOPT_OUTPUT_DIR": str(workdir)},
    )
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n1", type=int, default=5)
    parser.add_argument("--n2", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--launcher", default="basic", help="hydra/launcher for both: basic | submitit_local"
    )
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gpuopt_bench_"))
    (workdir / "conf").mkdir()
    (workdir / "task.py").write_text(TASK)
    (workdir / "conf" / "config.yaml").write_text(CONFIG)
    times: dict[tuple[str, int], list[float]] = {}
    index = 0
    try:
        for _ in range(args.repeats):
            for n in (args.n1, args.n2):
                for row in ROWS:  # alternate: drift hits every row alike
                    index += 1
                    times.setdefault((row, n), []).append(
                        run(workdir, row, n, args.launcher, index)
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"# bench_overhead: {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}"
    )
    print(
        f"# launcher={args.launcher}, trials N1={args.n1} N2={args.n2}, repeats={args.repeats}, "
        "median wall seconds per sweep (whole `-m` process)"
    )
    print(f"{'sweeper':<10} {'T(N1) s':>9} {'T(N2) s':>9} {'per trial ms':>13} {'fixed s':>8}")
    slope = {}
    for row in ROWS:
        t1, t2 = (
            statistics.median(times[(row, args.n1)]),
            statistics.median(times[(row, args.n2)]),
        )
        slope[row] = (t2 - t1) / (args.n2 - args.n1)
        fixed = t1 - slope[row] * args.n1
        print(f"{row:<10} {t1:9.2f} {t2:9.2f} {1000 * slope[row]:13.1f} {fixed:8.2f}")
    t2_ratio = statistics.median(times[("gpuopt", args.n2)]) / statistics.median(
        times[("optuna", args.n2)]
    )
    print(
        f"per-trial ratio gpuopt/stock: {slope['gpuopt'] / slope['optuna']:.3f} "
        f"(target <= 1.10); whole sweep of N2 trials: {t2_ratio:.3f}; gpuopt's own sampler "
        f"adds {1000 * (slope['gpuopt_tpe'] - slope['gpuopt']):.1f} ms per trial"
    )


if __name__ == "__main__":
    main()
