"""Trials per minute with 1, 2 and 4 sweep workers on one study, per storage kind.

Each worker is `python tests/sweep_helpers/fake_task.py -m ...` (gpuopt's configs and sweeper, a
stand-in engine that sleeps --trial-s seconds instead of training, in-process launcher), all started
with the same command and the same `hydra.sweeper.storage`. Throughput = counted trials / (last
trial's end - first trial's start), read from the study: process start-up is excluded.

    python scripts/bench_scale.py --trials 16 --trial-s 0.5 --workers 1 2 4

PostgreSQL runs on a throwaway local server (tests/helpers/postgres.py); it is skipped when the
server binaries are missing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FAKE = REPO / "tests" / "sweep_helpers" / "fake_task.py"
ARGS = [
    "~search",
    "measure=quick",
    "hydra.sweeper.device_aware=false",
    "hydra.sweeper.confirm.rounds=0",
    "hydra/launcher=basic",
    "loader.batch_size=choice(8,16,32,64)",
    "loader.num_workers=choice(0,1,2)",
]


def run(storage: str, workers: int, trials: int, trial_s: float, name: str) -> tuple[float, int]:
    import optuna

    from gpuopt.study.storage import open_storage
    from gpuopt.sweeper import owners

    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "GPUOPT_OUTPUT_DIR": out}
        cmd = [
            sys.executable,
            str(FAKE),
            "-m",
            *ARGS,
            f"hydra.sweeper.storage={storage}",
            f"hydra.sweeper.study_name={name}",
            f"hydra.sweeper.n_trials={trials}",
            f"model.sleep_s={trial_s}",
        ]
        procs = [
            subprocess.Popen(
                cmd, cwd=out, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            for _ in range(workers)
        ]
        for p in procs:
            _, err = p.communicate(timeout=600)
            if p.returncode:
                raise SystemExit(f"worker failed:\n{err.decode()[-2000:]}")
        study = optuna.load_study(study_name=name, storage=open_storage(storage, None, None))
        done = [t for t in study.get_trials() if owners.counted(t)]
        start = min(t.datetime_start for t in done)
        end = max(t.datetime_complete for t in done)
        return len(done) / ((end - start).total_seconds() / 60), len(done)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--trial-s", type=float, default=0.5)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--storages", nargs="+", default=["sqlite", "journal", "postgres"])
    a = ap.parse_args()
    print(f"load average before: {os.getloadavg()}; cores: {os.cpu_count()}")
    print(f"{'storage':<9} {'workers':>7} {'trials':>6} {'trials/min':>10} {'speedup':>8}")
    from contextlib import ExitStack

    from tests.helpers.postgres import find_pg_bin, postgres_server

    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        for kind in a.storages:
            if kind == "postgres" and find_pg_bin() is None:
                print("postgres: skipped (no server binaries)")
                continue
            base = None
            for n in a.workers:
                name = f"{kind}-{n}-{time.time_ns()}"
                if kind == "sqlite":
                    storage = f"sqlite:///{tmp}/{name}.db"
                elif kind == "journal":
                    storage = f"journal://{tmp}/{name}.log"
                else:
                    storage = stack.enter_context(postgres_server(f"db{n}"))
                rate, count = run(storage, n, a.trials, a.trial_s, name)
                base = base or rate
                print(f"{kind:<9} {n:>7} {count:>6} {rate:>10.1f} {rate / base:>7.2f}x", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
