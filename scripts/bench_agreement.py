"""Measurement agreement: gpuopt's throughput versus an independent timing of the same training step.

    python scripts/bench_agreement.py                          # mlp, mlp-best, cnn, 5 rounds (~8 min)
    python scripts/bench_agreement.py --models cnn --device cuda --rounds 3
    python scripts/bench_agreement.py --models transformer --device cuda model.width=1024 model.depth=12

Two independent checks per configuration, each in fresh processes, interleaved A B C D D C B A ...:

- end to end: gpuopt's `throughput` (`python -m gpuopt.run`, its DataLoader, its timed window)
  versus a plain loop written here, in its own process: the same model, dataset and DataLoader
  settings built straight from the config with hydra.utils.instantiate, AdamW/SGD, loss, backward,
  step, and the same flags (TF32 off for fp32 in matmuls and cuDNN, cudnn.benchmark as configured,
  autocast/GradScaler, non_blocking copies); a `time.perf_counter` synchronized at the two ends of
  a fixed number of steps after the same warm-up, never inside.
- compute only: gpuopt's `ceiling_throughput` (one batch already on the device, no loader) versus
  `torch.utils.benchmark.Timer.blocked_autorange` on the same step over one on-device batch.

Agreement = median(gpuopt) / median(independent) - 1; the goal is within 3%. Both end-to-end arms are
steady state (no epoch restart inside the timed span): gpuopt's `throughput`, not its
`throughput_amortized` (which adds the measured epoch boundary over the real epoch length). Between fresh processes
one configuration's throughput varies 4-14% on a 2-core machine between fresh processes, so medians of
several rounds are compared. scripts/bench_noise.py measures that process-to-process noise itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

from gpuopt.engines._ceiling import CEILING_BUDGET_SHARE

# The configurations compared: an input-bound one (loader work matters) and a compute-bound one.
# One compute thread: with two on a shared 2-core machine OpenMP's barriers make every number
# hostage to the other jobs (see bench_noise.py). The CNN is shrunk so a round takes seconds on a CPU.
CONFIGS = {
    "mlp": ["model=mlp", "loader.batch_size=128", "loader.num_workers=1", "device.num_threads=1"],
    "cnn": [
        "model=cnn",
        "model.width=16",
        "model.depth=1",
        "loader.batch_size=32",
        "loader.num_workers=0",
        "device.num_threads=1",
    ],
    # The default sweep's best on the 2-core machine (issue 15): big batches with a worker, where
    # epoch restarts inside a short window used to cost 15-20%.
    "mlp-best": [
        "model=mlp",
        "loader.batch_size=256",
        "loader.num_workers=1",
        "precision=bf16",
        "device.num_threads=1",
    ],
    "transformer": [
        "model=transformer",
        "loader.batch_size=16",
        "loader.num_workers=0",
        "device.num_threads=1",
    ],
}
GOAL = 0.03
# Both compute-only arms time the same span: utils.benchmark's min_run_time, and gpuopt's ceiling
# budget (CEILING_BUDGET_SHARE of measure.time_budget_s, ended by the budget, not a step count).
# With a 0.25 s ceiling a CNN step of ~110 ms gave gpuopt 3 replay steps against ~18 timed by
# utils.benchmark after its own calibration runs: not the same measurement.
COMPUTE_SPAN_S = 2.0


def _apply_flags(conf: dict[str, Any]) -> None:
    """The process-wide flags gpuopt's trial sets, written out here with torch's own API (not
    gpuopt.trial.policies, so the loop stays independent): fp32 turns TF32 off for matmuls and cuDNN
    convolutions alike (cuDNN's default allows TF32), tf32 turns it on, and cudnn.benchmark
    follows cache.cudnn_benchmark. PyTorch's defaults would compare a different setup on CUDA."""
    import torch

    tf32 = conf["precision"]["mode"] == "tf32"
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = bool(conf["cache"]["cudnn_benchmark"])
    if conf["device"]["num_threads"] is not None:
        torch.set_num_threads(int(conf["device"]["num_threads"]))


def _build(conf: dict[str, Any], device: Any) -> tuple[Any, Any, Any]:
    """(model, loader, optimizer) built straight from the config, as a user's script would."""
    import torch
    from hydra.utils import instantiate

    torch.manual_seed(conf["seed"])
    model_kwargs = {
        k: v
        for k, v in conf["model"].items()
        if k not in ("input", "input_shape", "num_classes", "channels_last")
    }
    model = instantiate(model_kwargs).to(device).train()
    if conf["model"].get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    loader_conf = conf["loader"]
    # epoch_steps is gpuopt's own key (the real epoch it amortizes over), not a dataset argument.
    data_conf = {k: v for k, v in conf["data"].items() if k != "epoch_steps"}
    loader = torch.utils.data.DataLoader(
        instantiate(data_conf),
        batch_size=loader_conf["batch_size"],
        shuffle=True,
        drop_last=True,
        num_workers=loader_conf["num_workers"],
        pin_memory=loader_conf["pin_memory"] and device.type == "cuda",
    )
    opt = conf["optimizer"]
    kwargs = {k: opt[k] for k in ("foreach", "fused") if opt.get(k) is not None}
    if opt["name"] == "sgd":
        optimizer = torch.optim.SGD(
            model.parameters(), lr=opt["lr"], momentum=opt["momentum"], **kwargs
        )
    else:
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=opt["lr"], weight_decay=opt["weight_decay"], **kwargs
        )
    return model, loader, optimizer


def _make_step(conf: dict[str, Any], model: Any, optimizer: Any, device: Any) -> Any:
    """The standard training step: autocast for fp16/bf16, a GradScaler for fp16, no host sync
    (the timers synchronize at their ends only)."""
    import contextlib

    import torch

    mode = conf["precision"]["mode"]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode)
    scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
    non_blocking = bool(conf["loader"]["non_blocking"])
    channels_last = bool(conf["model"].get("channels_last"))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> None:
        inputs = inputs.to(device, non_blocking=non_blocking)
        targets = targets.to(device, non_blocking=non_blocking)
        if channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        autocast = (
            torch.autocast(device_type=device.type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            outputs = model(inputs)
            if conf["loss"] == "mse":
                loss = torch.nn.functional.mse_loss(outputs, targets.to(outputs.dtype))
            else:
                loss = torch.nn.functional.cross_entropy(
                    outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)
                )
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def independent(
    overrides: list[str], steps: int, warmup: int, compute_only: bool
) -> dict[str, Any]:
    """Time the training step without gpuopt's measuring code (run in a fresh process), with the
    flags gpuopt's trial uses (`_apply_flags`)."""
    import torch
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf
    from torch.utils import benchmark

    import gpuopt.run  # noqa: F401  (registers the config schema, so the config composes)

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(config_name="config", overrides=overrides)
    conf = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(conf, dict)
    device = torch.device(
        "cuda"
        if conf["device"]["type"] in ("auto", "cuda") and torch.cuda.is_available()
        else "cpu"
    )
    _apply_flags(conf)
    model, loader, optimizer = _build(conf, device)
    step = _make_step(conf, model, optimizer, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()  # a CPU-GPU sync point: only at the clock reads

    batch_size = conf["loader"]["batch_size"]
    if compute_only:
        inputs, targets = (t.to(device) for t in next(iter(loader)))
        for _ in range(warmup):
            step(inputs, targets)
        sync()
        # No sync in the statement: utils.benchmark's timer synchronizes the accelerator at each
        # block's ends, as gpuopt's ceiling does at its replay's ends.
        timer = benchmark.Timer(
            stmt="step(inputs, targets)",
            globals={"step": step, "inputs": inputs, "targets": targets},
            num_threads=torch.get_num_threads(),
        )
        measurement = timer.blocked_autorange(min_run_time=COMPUTE_SPAN_S)
        # gpuopt's ceiling is samples / wall time of its replay steps, i.e. a mean: compare means.
        # The median of blocks (utils.benchmark's headline) ignores load spikes and reads higher.
        return {
            "throughput": batch_size / measurement.mean,
            "throughput_median": batch_size / measurement.median,
            "iqr_over_median": measurement.iqr / measurement.median,
        }

    def batches():
        # Steady state, as gpuopt's window: the synthetic epoch (262,144 samples) outlasts the
        # warm-up and the timed steps, so no epoch restart falls inside the timed span.
        while True:
            yield from loader

    it = batches()
    for _ in range(warmup):
        step(*next(it))
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*next(it))
    sync()
    return {"throughput": steps * batch_size / (time.perf_counter() - t0), "steps": steps}


def run_independent(
    overrides: list[str], steps: int, warmup: int, compute_only: bool
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--independent",
        json.dumps(overrides),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
    ] + (["--compute-only"] if compute_only else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=benchlib.REPO, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {
            "status": "error",
            "reason": proc.stderr[-500:],
            "metrics": {},
            "wall_s": time.perf_counter() - t0,
        }
    data = json.loads(lines[-1])
    return {
        "status": "ok",
        "metrics": {"throughput": data["throughput"]},
        "detail": data,
        "wall_s": time.perf_counter() - t0,
    }


def compare(name: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Both checks for one configuration: interleaved rounds, medians, agreement."""
    gpuopt_end = [
        *overrides,
        "measure.ceiling=false",
        "measure.count_flops=false",
        f"measure.warmup_steps={args.warmup}",
        f"measure.min_steps={args.steps}",
        f"measure.max_steps={args.steps}",
        "measure.time_budget_s=600",
    ]
    gpuopt_ceiling = [
        *overrides,
        "measure.ceiling=true",
        "measure.count_flops=false",
        f"measure.warmup_steps={args.warmup}",
        f"measure.time_budget_s={COMPUTE_SPAN_S / CEILING_BUDGET_SHARE:g}",
        "measure.max_steps=20",
        f"measure.ceiling_steps={args.ceiling_steps}",
    ]
    arms = {
        "gpuopt": lambda: benchlib.run_fresh(gpuopt_end),
        "plain loop": lambda: run_independent(overrides, args.steps, args.warmup, False),
        "gpuopt ceiling": lambda: _ceiling(benchlib.run_fresh(gpuopt_ceiling)),
        "utils.benchmark": lambda: run_independent(overrides, args.steps, args.warmup, True),
    }
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in arms}
    for r in range(args.rounds):
        for arm in benchlib.round_order(list(arms), r):
            result = arms[arm]()
            results[arm].append(result)
            print(
                f"  {name} round {r + 1}/{args.rounds} {arm:<16} {benchlib.fmt(benchlib.throughput(result))} "
                f"samples/s ({result.get('status')}, {result.get('wall_s', 0):.1f} s)",
                flush=True,
            )
    medians = {arm: benchlib.median_throughput(runs) for arm, runs in results.items()}
    spreads = {arm: benchlib.spread(runs) for arm, runs in results.items()}
    end = benchlib.ratio(medians["gpuopt"], medians["plain loop"])
    ceiling = benchlib.ratio(medians["gpuopt ceiling"], medians["utils.benchmark"])
    return {
        "config": name,
        "overrides": overrides,
        "medians": medians,
        "spreads": spreads,
        "throughputs": {
            arm: [benchlib.throughput(r) for r in runs] for arm, runs in results.items()
        },
        "agreement_end_to_end": None if end is None else end - 1,
        "agreement_compute": None if ceiling is None else ceiling - 1,
    }


def _ceiling(result: dict[str, Any]) -> dict[str, Any]:
    """A gpuopt result whose `throughput` is its compute ceiling (for the shared helpers)."""
    metrics = dict(result.get("metrics") or {})
    metrics["throughput"] = metrics.get("ceiling_throughput")
    return dict(result, metrics=metrics)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "mlp-best", "cnn"], choices=list(CONFIGS)
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of both end-to-end arms")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--ceiling-steps", type=int, default=1000, help="cap of gpuopt's replay (the span ends it)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--independent", help=argparse.SUPPRESS)
    parser.add_argument("--compute-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "overrides", nargs="*", help="extra overrides for every config (after its own: they win)"
    )
    args = parser.parse_args()

    if args.independent:
        print(
            json.dumps(
                independent(
                    json.loads(args.independent), args.steps, args.warmup, args.compute_only
                )
            )
        )
        return

    started, load_before, t0 = benchlib.now(), benchlib.load(), time.perf_counter()
    records = []
    for name in args.models:
        overrides = [*CONFIGS[name], f"device={args.device}", *args.overrides]
        records.append(compare(name, overrides, args))
    print(
        "\n| config | gpuopt | plain loop | agreement | gpuopt ceiling | torch.utils.benchmark | agreement |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in records:
        m = r["medians"]

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:+.1f}%" + (" ok" if abs(x) <= GOAL else " MISS")

        print(
            f"| {r['config']} ({' '.join(r['overrides'][1:])}) | {benchlib.fmt(m['gpuopt'])} | "
            f"{benchlib.fmt(m['plain loop'])} | {pct(r['agreement_end_to_end'])} | {benchlib.fmt(m['gpuopt ceiling'])} | "
            f"{benchlib.fmt(m['utils.benchmark'])} | {pct(r['agreement_compute'])} |"
        )
    out = {
        "command": benchlib.command_line(),
        "date": started,
        "machine": benchlib.machine(),
        "load_before": load_before,
        "load_after": benchlib.load(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "records": records,
    }
    print(
        f"\n{out['command']}  ({started}, {out['wall_s']} s, load {load_before} -> {out['load_after']})"
    )
    if args.json:
        benchlib.write_json(args.json, out)


if __name__ == "__main__":
    main()
