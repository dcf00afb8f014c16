"""A/A: how often gpuopt claims a difference that is not there, each way it compares, measured
exactly as a sweep makes the comparison; and, with a step made 10% slower on purpose, how often
it confirms a real one (the power).

    python scripts/bench_aa.py --workloads mlp cnn transformer --json benchmarks/aa_cpu.json

The ways (each with the sweep's own code and constants):
- screen: a race process as the race runs one (gpuopt.sweeper.race): the baseline as a whole
  trial, then the round's screen (`race.screen.screen`: the control build and identical
  candidates, each built and read in `race.slices` short windows, each between two baseline
  windows); the paired ratio over the baseline's windows, over the control's
  (`comparison.calibrated`; the raw ratio kept beside it). A claim: an identical candidate read
  below the race's floor (pruned as "cannot be an answer").
- whole: the same configuration as the race's finalists run: read over the baseline after the
  screen (`race.screen.read_over_baseline`), then a whole trial of that process told in the
  baseline's frame (`race.screen.over_baseline`), over the baseline's whole trial. A claim: a
  finalist below the race's floor (pruned: "no answer"), or above 1/floor.
- in-process: the confirmation's rounds (`rounds.run_rounds` on the comparison service, Stein's
  two-stage stop) in a
  shared process of the baseline and an identical candidate, its plan sized as the default
  sweep's; `verdicts.compare`. A claim: the 95% interval excludes 1.0x.
- fresh: the same rounds in fresh processes (a user app's confirmation). A claim: its interval,
  at the fresh-process level (`rounds.FRESH_LEVEL`, 98%), excludes 1.0x.
- power: the in-process confirmation of the baseline against the same model made 10% slower
  (scripts/slowed.py): how often the interval excludes 1.0x on the right side.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from gpuopt.core.stats import LEVEL, two_sided
from gpuopt.study.records import ConfirmedConfig
from gpuopt.sweeper.comparison import Executor, Measurement, calibrated
from gpuopt.sweeper.confirm import in_process, schedule
from gpuopt.sweeper.confirm.rounds import FRESH_LEVEL, Rule, run_rounds
from gpuopt.sweeper.confirm.verdicts import compare
from gpuopt.sweeper.options import ConfirmOptions, RaceOptions
from gpuopt.sweeper.race import policy, screen
from gpuopt.sweeper.shared_process import SharedProcess

SCRIPTS = Path(__file__).resolve().parent
# The default sweep's fixed measure settings (conf/search/default.yaml).
FIXED = [
    "device=cpu",
    "measure.warmup_steps=3",
    "measure.time_budget_s=2.0",
    "measure.min_time_s=1.0",
    "measure.ceiling_steps=10",
]
OBJECTIVE = "throughput_amortized"
MODELS = {
    "mlp": "gpuopt.workload.models.MLP",
    "cnn": "gpuopt.workload.models.SmallCNN",
    "transformer": "gpuopt.workload.models.TinyTransformer",
}
DEFAULT_TRIALS = 10  # the default sweep's n_trials: the confirmation's run cap follows it


def arms(model: str, slowdown: float = 0.0) -> dict[str, list[str]]:
    base = [*FIXED, f"model={model}"]
    arms = {"baseline": base, "candidate1": list(base)}
    if slowdown:
        arms["candidate1"] += [
            "model._target_=slowed.build",
            f"+model.inner={MODELS[model]}",
            f"+model.slowdown={slowdown}",
            "trust=[slowed.*]",
        ]
    return arms


def screen_and_whole(model: str, per_run: int, wholes: int) -> dict[str, list[float]]:
    """One race process: the screen's ratios of `per_run` identical candidates (raw, and over
    the round's control as the race reads them: policy.CONTROL), then `whole` whole trials of the
    same configuration against the baseline's."""
    folder = Path(tempfile.mkdtemp(prefix="gpuopt-aa-"))
    window_s = RaceOptions().window_s
    base = [*FIXED, f"model={model}"]
    paths = benchlib.composed_configs(
        folder,
        {
            "trial0": [*base, "profile=on"],
            "baseline": base,
            "candidate": [*base, policy.SCREEN_WARMUP],
        },
    )
    race = SharedProcess.open(folder, "throughput", window_s)
    try:
        first = race.whole_trial("#0", paths["trial0"], folder / "trial_0")
        assert first is not None and first.ok, race.error or first
        assert race.add(policy.BASELINE, paths["baseline"]).status == "ok", race.error
        labels = [policy.CONTROL, *(f"#{i + 1}" for i in range(per_run))]
        compared, _ = screen.screen(
            race,
            dict.fromkeys(labels, paths["candidate"]),
            "throughput",
            RaceOptions(),
            restart=functools.partial(_no_restart, race),
            report=lambda *_: None,
        )
        raw = screen.raw_ratios(compared, "throughput")
        ratios, control = calibrated(raw, policy.CONTROL)
        read = whole_trials(race, paths["candidate"], folder, base, first, control, wholes)
        race.drop(policy.BASELINE)
    finally:
        race.close()
    return {
        "screen": [ratios[label] for label in labels[1:]],
        "screen_raw": [raw[label] for label in labels[1:]],
        "whole": read,
    }


def _no_restart(race: SharedProcess) -> SharedProcess:
    raise AssertionError(f"the race process failed: {race.error}")


def whole_trials(
    race: SharedProcess,
    screened: Path,
    folder: Path,
    base: list[str],
    first: Any,
    control: float | None,
    n: int,
) -> list:
    """`n` finalists of the baseline's configuration as the race runs them: each read over the
    baseline (its screened config), then its whole trial told in the baseline's frame; each
    told throughput over the baseline's whole trial's (trial 0)."""
    config = benchlib.composed_configs(folder, {"whole": base})["whole"]
    baseline = first.metrics.__dict__
    restart = functools.partial(_no_restart, race)
    out = []
    for i in range(n):
        paired, _ = screen.read_over_baseline(
            race, f"w{i}", screened, OBJECTIVE, RaceOptions(), restart, control
        )
        result = race.whole_trial(f"w{i}", config, folder / f"whole_{i}")
        assert result is not None and result.ok, race.error or result
        told, _ = screen.over_baseline(result, baseline, paired)
        out.append(told.metrics.throughput / first.metrics.throughput)
    return out


def _configs() -> list[ConfirmedConfig]:
    return [ConfirmedConfig(label, i, {}, []) for i, label in enumerate(schedule.labels([0, 1]))]


def confirmation(
    measure: Executor, plan: schedule.ConfirmPlan, how: str, level: float = LEVEL
) -> dict[str, Any]:
    """The confirmation's rounds and verdict, as the sweep's end runs them (`level`: the
    interval's, FRESH_LEVEL in fresh processes)."""
    options = ConfirmOptions()
    configs = _configs()
    rule = Rule("maximize", options.target_halfwidth, level)
    done = run_rounds(configs, plan, OBJECTIVE, measure, rule, how=how)
    verdict = compare(
        configs, "maximize", options.target_halfwidth, plan.rounds, done.loads, level=level
    )
    return verdict["comparisons"][0]


def in_process_confirmation(model: str, slowdown: float, trial_s: float) -> dict[str, Any]:
    """The baseline and candidate1 in one shared process, windows as the confirmation's (each on
    a build of its own)."""
    options = ConfirmOptions()
    folder = Path(tempfile.mkdtemp(prefix="gpuopt-aa-confirm-"))
    paths = benchlib.composed_configs(folder, arms(model, slowdown))
    shared = SharedProcess.start(paths, {}, OBJECTIVE, options.window_s, folder)
    try:
        fresh = schedule.plan(options.top_k, options.rounds, options.max_share, DEFAULT_TRIALS, 1)
        assert fresh is not None
        first, cap = in_process.window_plan(
            fresh.rounds, fresh.max_runs, [trial_s] * DEFAULT_TRIALS, [options.window_s] * 2
        )
        plan = schedule.ConfirmPlan(1, first, cap)
        return confirmation(in_process.fresh_build_windows(shared), plan, "in-process")
    finally:
        shared.close()


def fresh_confirmation(model: str) -> dict[str, Any]:
    """The rounds in fresh processes (`python -m gpuopt.run`), the fresh-process plan."""
    options = ConfirmOptions()
    overrides = arms(model)
    plan = schedule.plan(options.top_k, options.rounds, options.max_share, DEFAULT_TRIALS, 1)
    assert plan is not None

    def measure(label: str, job: int, so_far: Any) -> Measurement:
        result = benchlib.run_fresh(overrides[label])
        value = (result.get("metrics") or {}).get(OBJECTIVE)
        return Measurement("ok", value) if value else Measurement("error")

    return confirmation(measure, plan, "fresh processes", FRESH_LEVEL)


def claimed(entry: dict[str, Any]) -> bool:
    return bool(entry.get("distinguishable"))


def summary(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def race_ways(model: str, runs: int, per_run: int, whole: int, log: Callable) -> dict[str, Any]:
    floor = RaceOptions().floor
    per_run_medians, raw_medians, screen, wholes = [], [], [], []
    for r in range(runs):
        out = screen_and_whole(model, per_run, whole)
        screen += out["screen"]
        wholes += out["whole"]
        per_run_medians.append(statistics.median(out["screen"]))
        raw_medians.append(statistics.median(out["screen_raw"]))
        log(
            f"{model} race run {r + 1}/{runs}: screen {fmt(out['screen'])} "
            f"(raw {fmt(out['screen_raw'])}), whole {fmt(out['whole'])}"
        )
    return {
        "screen": {
            **summary(screen),
            "run_medians": per_run_medians,
            "raw_run_medians": raw_medians,
            "run_median_spread": max(per_run_medians) - min(per_run_medians),
            "claims": sum(1 for x in screen if x < floor),
            "ratios": screen,
        },
        "whole": {
            **summary(wholes),
            "claims": sum(1 for x in wholes if x < floor or x > 1 / floor),
            "ratios": wholes,
        },
    }


def confirm_way(name: str, run: Callable[[], dict[str, Any]], n: int, log: Callable) -> dict:
    entries = []
    for i in range(n):
        entries.append(run())
        e = entries[-1]
        log(f"{name} {i + 1}/{n}: {e.get('ratio', 0):.3f}x [{e.get('ci_low')}-{e.get('ci_high')}]")
    ratios = [e["ratio"] for e in entries if e.get("ratio")]
    return {
        **summary(ratios),
        "claims": sum(1 for e in entries if claimed(e)),
        "claim_rate": sum(1 for e in entries if claimed(e)) / max(1, len(entries)),
        "entries": entries,
    }


def rescored(paths: Sequence[str], way: str, levels: Sequence[float]) -> dict[str, Any]:
    """The claims the recorded comparisons of `way` would make at other interval levels: each
    entry's interval is mean log-ratio +- t(df) x sd / sqrt(pairs), so its half-width scales by
    the ratio of the two levels' t quantiles (df: the one that gives the recorded half-width)."""
    entries = [
        e
        for path in paths
        for ways in json.loads(Path(path).read_text()).values()
        if isinstance(ways, dict) and isinstance(ways.get(way), dict)
        for e in ways[way]["entries"]
        if e.get("log_sd") and e.get("halfwidth") is not None
    ]
    claims = dict.fromkeys(levels, 0)
    for e in entries:
        half, n, sd = math.asinh(e["halfwidth"]), e["n_pairs"], e["log_sd"]
        df = min(
            range(1, n), key=lambda k: abs(two_sided(e.get("level", LEVEL), k) * sd - half * n**0.5)
        )
        for level in levels:
            new = half * two_sided(level, df) / two_sided(e.get("level", LEVEL), df)
            claims[level] += abs(math.log(e["ratio"])) > new
    return {"files": list(paths), "way": way, "n": len(entries), "claims": claims}


def fmt(values: Sequence[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["mlp", "cnn", "transformer"])
    parser.add_argument("--ways", nargs="+", default=["race", "in-process", "fresh", "power"])
    parser.add_argument("--runs", type=int, default=4, help="race processes per workload")
    parser.add_argument("--per-run", type=int, default=5, help="screened candidates per run")
    parser.add_argument("--whole", type=int, default=5, help="whole trials per run")
    parser.add_argument("--confirmations", type=int, default=20)
    parser.add_argument("--fresh", type=int, default=20, help="fresh-process confirmations (mlp)")
    parser.add_argument("--slowdown", type=float, default=0.1)
    parser.add_argument("--trial-s", type=float, default=5.0, help="a trial's seconds (the plan)")
    parser.add_argument("--json")
    parser.add_argument("--rescore", nargs="+", help="recorded JSONs: their claims at --levels")
    parser.add_argument("--levels", nargs="+", type=float, default=[LEVEL, FRESH_LEVEL])
    args = parser.parse_args()
    if args.rescore:
        for way in ("fresh", "in-process", "power"):
            print(json.dumps(rescored(args.rescore, way, args.levels)))
        return 0
    # the shared processes import scripts/slowed.py (the power's slowed model)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])
    )
    out: dict[str, Any] = {"date": benchlib.now(), "load_before": benchlib.load()}

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    for model in args.workloads:
        ways: dict[str, Any] = {}
        if "race" in args.ways:
            ways.update(race_ways(model, args.runs, args.per_run, args.whole, log))
        if "in-process" in args.ways:
            run = functools.partial(in_process_confirmation, model, 0.0, args.trial_s)
            ways["in-process"] = confirm_way("in-process", run, args.confirmations, log)
        if "fresh" in args.ways and model == "mlp":
            run = functools.partial(fresh_confirmation, model)
            ways["fresh"] = confirm_way("fresh", run, args.fresh, log)
        if "power" in args.ways:
            run = functools.partial(in_process_confirmation, model, args.slowdown, args.trial_s)
            ways["power"] = confirm_way("power", run, args.confirmations, log)
        out[model] = ways
        print(
            model,
            {k: {m: v[m] for m in ("n", "median", "claims") if m in v} for k, v in ways.items()},
        )
    if args.json:
        out.update(machine=benchlib.machine(), command=benchlib.command_line())
        benchlib.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
