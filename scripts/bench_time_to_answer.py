"""Time to a confirmed answer: the default sweep, the race (new) against fresh processes (old).

    python scripts/bench_time_to_answer.py --json benchmarks/time_to_answer_cpu.json
    python scripts/bench_time_to_answer.py --workloads mlp --ways new old new old

For each workload (`model=mlp | cnn | transformer`), the default sweep (`python -m gpuopt.run -m
model=W`, conf/search/default.yaml: 10 trials, the confirmation round, the best's profile) runs on
a fresh output dir, once per way, the ways alternating within the run (new old, then old new for
the next workload, so neither always runs on a warmer or a busier machine):
  - new: the defaults (the race where the space shares one process: gpuopt/sweeper/race/);
  - old: `hydra.sweeper.race.enabled=false` plus OLD_PROTOCOL, which restores the protocol
    before the race (a fresh process per trial, 1 s confirmation windows).
Recorded per run: the wall time of the command, where the time went (the sweep's timing.json:
plan, trials, confirmation, profile), the answer (best trial, its params, the confirmed speedup
over the baseline and its 95% interval, the interval's half-width, the verdict), the load
average before it, and where the whole trials' time went: each phase of the trial's phase clock
(the trial's `phases` user attr, docs/measuring.md: build, flops, warmup, window, ..., guard)
summed over the sweep's trials that ran whole. Two markdown tables are printed (the sweep; the
phases); `--json` keeps every run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

# What restores the protocol before the race (the defaults it changed).
OLD_PROTOCOL = ["hydra.sweeper.race.enabled=false", "hydra.sweeper.confirm.window_s=1.0"]
WAYS = {"new": [], "old": OLD_PROTOCOL}


def run_sweep(workload: str, way: str, extra: list[str], timeout_s: float) -> dict[str, Any]:
    """One default sweep in a fresh output dir; what it took and what it answered."""
    out = Path(tempfile.mkdtemp(prefix=f"gpuopt-tta-{workload}-{way}-"))
    cmd = [sys.executable, "-m", "gpuopt.run", "-m", f"model={workload}", *WAYS[way], *extra]
    env = {**os.environ, "GPUOPT_OUTPUT_DIR": str(out)}
    load = benchlib.load()
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - started
    record: dict[str, Any] = {
        "workload": workload,
        "way": way,
        "command": " ".join(cmd[1:]),
        "wall_s": round(wall, 1),
        "returncode": done.returncode,
        "load_before": load,
        "output_dir": str(out),
    }
    if done.returncode != 0:
        record["stderr_tail"] = done.stderr[-2000:]
        return record
    record.update(read_timing(out))
    record.update(read_answer(out))
    record.update(read_phases(out))
    return record


def read_timing(out: Path) -> dict[str, Any]:
    """The sweep's timing.json (gpuopt/sweeper/loop.py, PhaseClock)."""
    found = sorted(out.glob("sweeps/*/*/timing.json"))
    return {"timing": json.loads(found[-1].read_text())} if found else {}


def read_answer(out: Path) -> dict[str, Any]:
    """The confirmed answer from the study: the winner and its comparison with the baseline."""
    import optuna

    from gpuopt.study.records import read_confirmation

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'gpuopt.db'}")
    confirmation = read_confirmation(study.user_attrs)
    if confirmation is None:
        return {"answer": None}
    winner = confirmation.winner
    best = confirmation.comparison_of(winner) if winner is not None else None
    top = best or (confirmation.comparisons[0] if confirmation.comparisons else None)
    trial = study.trials[winner] if winner is not None else None
    return {
        "answer": {
            "winner": winner,
            "params": dict(trial.params) if trial is not None else None,
            "kept_baseline": winner == confirmation.baseline_number,
            "mode": confirmation.mode,
            "rounds": confirmation.rounds,
            "compared_trial": top.trial_number if top else None,
            "speedup": top.ratio if top else None,
            "ci": [top.ci_low, top.ci_high] if top else None,
            "halfwidth": top.halfwidth if top else None,
            "verdict": top.verdict if top else None,
        },
        "states": _states(study),
    }


def read_phases(out: Path) -> dict[str, Any]:
    """Each phase's seconds summed over the study's whole trials (those that carry a phase clock:
    the race's baseline and finalists, or every trial without the race), and how many there were."""
    import optuna

    from gpuopt.core.result import ATTR_PHASES

    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'gpuopt.db'}")
    totals: dict[str, float] = {}
    clocked = [t.user_attrs[ATTR_PHASES] for t in study.trials if ATTR_PHASES in t.user_attrs]
    for phases in clocked:
        for name, seconds in phases.items():
            totals[name] = totals.get(name, 0.0) + float(seconds)
    return {"whole_trials": len(clocked), "phases": {k: round(v, 2) for k, v in totals.items()}}


def phase_table(runs: list[dict[str, Any]]) -> str:
    """Seconds per phase, summed over each run's whole trials (the columns: every phase seen)."""
    names: list[str] = []
    for r in runs:
        names += [n for n in r.get("phases") or {} if n not in names]
    head = "| workload | way | whole trials | " + " | ".join(names) + " | sum |"
    rows = [head, "|" + "---|" * (len(names) + 4)]
    for r in runs:
        phases = r.get("phases") or {}
        cells = [r["workload"], r["way"], str(r.get("whole_trials", "-"))]
        cells += [f"{phases[n]:.1f}" if n in phases else "-" for n in names]
        cells.append(f"{sum(phases.values()):.1f}" if phases else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _states(study: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in study.trials:
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    return counts


def schedule(workloads: list[str], ways: list[str]) -> list[tuple[str, str]]:
    """Every workload with every way, the ways' order reversed from one workload to the next."""
    runs = []
    for i, workload in enumerate(workloads):
        order = ways if i % 2 == 0 else list(reversed(ways))
        runs += [(workload, way) for way in order]
    return runs


def table(runs: list[dict[str, Any]]) -> str:
    head = (
        "| workload | way | wall | plan | trials | confirmation | profile | answer "
        "| confirmed speedup [95% CI] | +- | load |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for r in runs:
        t = r.get("timing") or {}
        a = r.get("answer") or {}
        ci = a.get("ci") or [None, None]
        speed = (
            f"{a['speedup']:.2f}x [{ci[0]:.2f}-{ci[1]:.2f}]"
            if a.get("speedup") and None not in ci
            else "-"
        )
        answer = "keep baseline" if a.get("kept_baseline") else f"#{a.get('winner')}"
        half = f"{100 * a['halfwidth']:.1f}%" if a.get("halfwidth") else "-"
        cells = [
            r["workload"],
            r["way"],
            f"{r['wall_s']:.0f} s" if r.get("returncode") == 0 else f"failed ({r['returncode']})",
            *(f"{t[k]:.0f} s" if k in t else "-" for k in PHASES),
            answer,
            speed,
            half,
            r["load_before"].split()[0],
        ]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


PHASES = ("plan_s", "trials_s", "confirmation_s", "profile_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn", "transformer"])
    parser.add_argument("--ways", nargs="+", default=["new", "old"], choices=sorted(WAYS))
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--json", help="write every run here")
    parser.add_argument("extra", nargs="*", help="overrides added to every sweep")
    args = parser.parse_args()
    runs = []
    for workload, way in schedule(args.workloads, args.ways):
        print(f"{benchlib.now()} {workload} {way} ...", file=sys.stderr, flush=True)
        runs.append(run_sweep(workload, way, args.extra, args.timeout_s))
        print(json.dumps(runs[-1], default=str), file=sys.stderr, flush=True)
    print(table(runs))
    print()
    print(phase_table(runs))
    if args.json:
        benchlib.write_json(
            args.json,
            {"machine": benchlib.machine(), "command": benchlib.command_line(), "runs": runs},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
