"""Speedup of gpuopt's tuned configuration over PyTorch defaults, and over Lightning's batch-size finder.

    python scripts/bench_speedup.py --models mlp              # one workload (~4-6 min on 2 cores)
    python scripts/bench_speedup.py --models mlp cnn transformer --lightning --json out.json

For each built-in workload, in one run:

1. the default sweep, as a user runs it: `python -m gpuopt.run -m model=M` (preset search=default,
   its n_trials, in a throw-away output dir); its best trial's params are read from the study;
2. with --lightning: Lightning's `Tuner.scale_batch_size` (mode power and binsearch) on the same
   workload (a LightningModule around the same model, loss, optimizer and dataset, with PyTorch's
   DataLoader defaults) picks its batch size; each runs in its own process;
3. the arms, measured back to back in fresh `python -m gpuopt.run` processes, interleaved
   A B [C D] A B [C D] ... (`--repeats` rounds), all with the same timed-window settings:
   - defaults: PyTorch's defaults (batch 32, num_workers 0, fp32, no compile, no pinned memory,
     PyTorch's thread count);
   - gpuopt: the sweep's best params (everything else as defaults);
   - lightning-power / lightning-binsearch: the finder's batch size, everything else as defaults
     (the finder tunes nothing else).
Reported: median throughput of each arm, its spread over rounds, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

MODELS = ("mlp", "cnn", "transformer")


def _utilizations() -> tuple[str, ...]:
    """util.gpu, GPM's metrics (the catalogue's) and MFU: what a sweep's baseline and best record."""
    from gpuopt.core.metrics import METRICS

    return ("utilization", *(m.name for m in METRICS if m.gpm), "mfu")


PYTORCH_DEFAULTS = [
    "loader.batch_size=32",
    "loader.num_workers=0",
    "loader.pin_memory=false",
    "precision=fp32",
    "compile=off",
    "device.num_threads=null",
]
FINDER_MODES = ("power", "binsearch")


# -- 1. the default sweep ----------------------------------------------------------------------------


def default_sweep(
    model: str, device: str, n_trials: int | None, extra: list[str]
) -> dict[str, Any]:
    """Run `python -m gpuopt.run -m model=M` in a throw-away output dir; the best trial's params
    (as the sweeper picked it, after its confirmation round) and the sweep's cost."""
    import optuna
    from omegaconf import OmegaConf

    from gpuopt.study.rules import pick_baseline
    from gpuopt.sweeper.space import override_text

    with tempfile.TemporaryDirectory(prefix="gpuopt_sweep_") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "gpuopt.run",
            "-m",
            f"model={model}",
            f"device={device}",
            f"output_dir={tmp}",
            f"hydra.sweep.dir={tmp}/sweep",
            *extra,
        ]
        if n_trials is not None:
            cmd.append(f"hydra.sweeper.n_trials={n_trials}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, check=False, cwd=benchlib.REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        results_file = Path(tmp) / "sweep" / "optimization_results.yaml"
        if proc.returncode != 0 or not results_file.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise RuntimeError(
                f"sweep failed ({' '.join(cmd)}):\n{tail}\n{_trial_reasons(Path(tmp))}"
            )
        results = OmegaConf.to_container(OmegaConf.load(results_file))
        assert isinstance(results, dict)
        study = optuna.load_study(study_name=results["study_name"], storage=results["storage"])
        best = study.trials[int(results["best_trial"])]
        baseline = pick_baseline(study.trials)
        summary = (Path(tmp) / "sweep" / "summary.txt").read_text()
        return {
            "command": " ".join(cmd[1:]).replace(tmp, "<tmp>"),
            "wall_s": round(wall, 1),
            "trials": len(study.trials),
            "best_trial": best.number,
            "best_params": best.params,
            "best_values": best.values,
            "overrides": [override_text(k, v) for k, v in best.params.items()],
            "summary": summary,
            # util.gpu beside GPM's SM, tensor-core and DRAM activity, and MFU (docs/measuring.md)
            "utilizations": {
                role: {k: trial.user_attrs.get(k) for k in _utilizations()}
                for role, trial in (("baseline", baseline), ("best", best))
                if trial is not None
            },
        }


def _trial_reasons(output_dir: Path) -> str:
    """Why the trials of a failed sweep failed (their `reason` user attrs), before the output
    directory is thrown away."""
    import optuna

    lines = []
    for db in output_dir.glob("*.db"):
        for summary in optuna.get_all_study_summaries(f"sqlite:///{db}"):
            study = optuna.load_study(study_name=summary.study_name, storage=f"sqlite:///{db}")
            for t in study.trials:
                if t.user_attrs.get("reason"):
                    lines.append(f"  trial {t.number} {t.params}: {t.user_attrs['reason']}")
    return "\n".join(lines) or "  (no trial reasons recorded)"


# -- 2. Lightning's batch-size finder ---------------------------------------------------------------


def find_batch_size(
    model: str, device: str, mode: str, max_val: int, init_val: int
) -> dict[str, Any]:
    """Lightning's Tuner.scale_batch_size on the workload, in this process (run it in a fresh one)."""
    import lightning.pytorch as pl
    import torch
    from hydra import compose, initialize_config_module
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader

    import gpuopt.run  # noqa: F401  (registers the config schema)
    from gpuopt.core.spec import MODEL_META_KEYS
    from gpuopt.engines._build import instantiate_trusted as _instantiate
    from gpuopt.engines.lightning.engine import BuiltinModule
    from gpuopt.trial.prepare import load_spec

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(
            config_name="config",
            overrides=[f"model={model}", f"device={device}", *PYTORCH_DEFAULTS],
        )
    spec = load_spec(cfg)
    dataset = _instantiate(spec.data, spec.trusted_targets)

    class FinderModule(BuiltinModule):
        """gpuopt's built-in module plus what the finder needs: a `batch_size` attribute and a
        train_dataloader with PyTorch's DataLoader defaults (the user's code before tuning)."""

        def __init__(self) -> None:
            torch.manual_seed(spec.seed)
            model_kwargs = {k: v for k, v in spec.model.items() if k not in MODEL_META_KEYS}
            super().__init__(_instantiate(model_kwargs, spec.trusted_targets), spec)
            self.batch_size = init_val

        def train_dataloader(self) -> DataLoader:
            return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuopt_finder_") as root:  # the finder's checkpoint
        trainer = pl.Trainer(
            accelerator="gpu" if device.startswith("cuda") else "cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        picked = Tuner(trainer).scale_batch_size(
            FinderModule(), mode=mode, init_val=init_val, max_val=max_val, steps_per_trial=3
        )
    return {
        "mode": mode,
        "batch_size": int(picked),
        "seconds": round(time.perf_counter() - t0, 1),
        "max_val": max_val,
        "init_val": init_val,
        "dataset_size": len(dataset),
    }


def run_finder(model: str, device: str, mode: str, max_val: int, init_val: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--find-batch",
        model,
        mode,
        "--device",
        device,
        "--finder-max-val",
        str(max_val),
        "--finder-init-val",
        str(init_val),
    ]
    proc = subprocess.run(cmd, check=False, cwd=benchlib.REPO, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"finder failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


# -- 3. the arms, interleaved ---------------------------------------------------------------------


def bench_model(model: str, args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    base = [
        f"model={model}",
        f"device={args.device}",
        *benchlib.LEAN_MEASURE,
        f"measure.time_budget_s={args.window_s}",
        *args.overrides,
    ]
    record: dict[str, Any] = {"model": model, "load_before": benchlib.load()}
    log(f"== {model}: default sweep (load {benchlib.load()})")
    sweep = default_sweep(model, args.device, args.trials, list(args.overrides))
    record["sweep"] = sweep  # with its summary text: what the user would have been told
    log(
        f"  {sweep['trials']} trials in {sweep['wall_s']} s; best #{sweep['best_trial']}: {sweep['best_params']}"
    )
    arms = {
        "defaults": base + PYTORCH_DEFAULTS,
        "gpuopt": base + PYTORCH_DEFAULTS + sweep["overrides"],
    }
    if args.lightning:
        record["finder"] = {}
        for mode in FINDER_MODES:
            found = run_finder(model, args.device, mode, args.finder_max_val, args.finder_init_val)
            record["finder"][mode] = found
            log(
                f"  Lightning scale_batch_size(mode={mode}): batch {found['batch_size']} in {found['seconds']} s"
            )
            arms[f"lightning-{mode}"] = (
                base + PYTORCH_DEFAULTS + [f"loader.batch_size={found['batch_size']}"]
            )
    log(f"  arms interleaved x{args.repeats} (fresh processes, timed window {args.window_s} s)")
    results = benchlib.interleave(arms, args.repeats, log=log)
    record["arms"] = {}
    for name, runs in results.items():
        record["arms"][name] = {
            "overrides": arms[name][len(base) :],
            "throughput": [benchlib.throughput(r) for r in runs],
            "median": benchlib.median_throughput(runs),
            "spread": benchlib.spread(runs),
            "status": [r.get("status") for r in runs],
        }
    medians = {name: arm["median"] for name, arm in record["arms"].items()}
    record["ratios"] = {
        f"gpuopt/{name}": benchlib.ratio(medians["gpuopt"], m)
        for name, m in medians.items()
        if name != "gpuopt"
    }
    record["load_after"] = benchlib.load()
    return record


def report(records: list[dict[str, Any]]) -> str:
    arm_names = list(records[0]["arms"])
    head = "| model | " + " | ".join(f"{a} (samples/s, spread)" for a in arm_names)
    head += (
        " | "
        + " | ".join(f"gpuopt / {a}" for a in arm_names if a != "gpuopt")
        + " | gpuopt best params |"
    )
    lines = [head, "|" + "---|" * (2 * len(arm_names) + 1)]
    for r in records:
        cells = []
        for a in arm_names:
            arm = r["arms"][a]
            sp = f"{100 * arm['spread']:.0f}%" if arm["spread"] is not None else "-"
            cells.append(f"{benchlib.fmt(arm['median'])} ({sp})")
        ratios = [r["ratios"][f"gpuopt/{a}"] for a in arm_names if a != "gpuopt"]
        cells += [f"{x:.2f}x" if x is not None else "-" for x in ratios]
        params = ", ".join(f"{k}={v}" for k, v in r["sweep"]["best_params"].items())
        lines.append(f"| {r['model']} | " + " | ".join(cells) + f" | {params} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--trials", type=int, default=None, help="sweep n_trials (default: the preset's)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the arms")
    parser.add_argument("--window-s", type=float, default=4.0, help="timed window of the A/B runs")
    parser.add_argument(
        "--lightning", action="store_true", help="also Lightning's batch-size finder arms"
    )
    parser.add_argument(
        "--finder-max-val",
        type=int,
        default=1024,
        help="cap of the finder's batch size (on a CPU nothing OOMs below huge sizes)",
    )
    parser.add_argument(
        "--finder-init-val", type=int, default=2, help="the finder's first batch size"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--find-batch", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra overrides for the sweep and every arm")
    args = parser.parse_args()

    if args.find_batch:
        print(
            json.dumps(
                find_batch_size(
                    args.find_batch[0],
                    args.device,
                    args.find_batch[1],
                    args.finder_max_val,
                    args.finder_init_val,
                )
            )
        )
        return

    started = benchlib.now()
    t0 = time.perf_counter()
    records = []
    for model in args.models:
        records.append(bench_model(model, args))
        print(report(records[-1:]), flush=True)
    out = {
        "command": benchlib.command_line(),
        "date": started,
        "machine": benchlib.machine(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "records": records,
    }
    print()
    print(report(records))
    print(f"\n{out['command']}  ({started}, {out['wall_s']} s)")
    if args.json:
        benchlib.write_json(args.json, out)


if __name__ == "__main__":
    main()
