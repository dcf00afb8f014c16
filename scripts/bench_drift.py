"""The numerics guard's `loss_drift` for each low precision and each accumulation split, per workload.

    python scripts/bench_drift.py                              # mlp, cnn, transformer on the CPU
    python scripts/bench_drift.py --models mlp --global-batch 256 --json drift.json

For every built-in workload, at one global batch (default 256): the guard (gpuopt.engines._guard.check,
exactly what a trial runs outside its timed window: K optimizer steps from the seeded weights on the
dataset's first K global batches, against the fp32 reference of the same global batch in one pass)
for
  - precision bf16 and fp16 at the whole global batch (micro-batch = global batch);
  - every accumulation split in fp32: micro-batch global/2, /4, /8, /16 (the same math up to the
    order of the float sums: drift ~ 1e-7 is rounding, anything larger is a bug);
  - bf16 with 4 micro-steps (both changes at once).
Reported: loss_drift, the guard's verdict at the default tolerance, the first and last reference
loss (the data is learnable: the loss must fall over the K steps for the check to mean anything).
Deterministic: no timing, so the machine's load does not matter (the arithmetic does: a CPU with
native bf16 rounds differently from one that emulates it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

MODELS = ("mlp", "cnn", "transformer")


def variants(global_batch: int) -> list[tuple[str, list[str]]]:
    """(label, overrides) of every configuration checked against the fp32 reference."""
    whole = [f"train.global_batch={global_batch}", f"loader.batch_size={global_batch}"]
    rows = [("bf16", [*whole, "precision=bf16"]), ("fp16", [*whole, "precision=fp16"])]
    for k in (2, 4, 8, 16):
        if global_batch % k == 0:
            micro = global_batch // k
            rows.append(
                (
                    f"fp32 {k} x {micro}",
                    [f"train.global_batch={global_batch}", f"loader.batch_size={micro}"],
                )
            )
    if global_batch % 4 == 0:
        micro = global_batch // 4
        rows.append(
            (
                f"bf16 4 x {micro}",
                [
                    f"train.global_batch={global_batch}",
                    f"loader.batch_size={micro}",
                    "precision=bf16",
                ],
            )
        )
    return rows


def check(overrides: list[str]) -> dict[str, Any]:
    """Compose the config, validate it as a trial does, run the guard on the CPU."""
    from hydra import compose, initialize_config_module

    import gpuopt.run  # noqa: F401  (registers the config schema)
    from gpuopt.engines import _guard
    from gpuopt.trial.devices import resolve_device
    from gpuopt.trial.prepare import load_spec

    with initialize_config_module(config_module="gpuopt.conf"):
        cfg = compose(config_name="config", overrides=overrides)
    spec = load_spec(cfg)
    evidence = _guard.check(spec, resolve_device(spec.device.type))
    return {
        "loss_drift": evidence.loss_drift,
        "passed": evidence.passed,
        "tolerance": evidence.tolerance,
        "steps": evidence.steps,
        "changes": evidence.changes,
        "skipped_steps": evidence.skipped_steps,
        "reference_first": evidence.reference_losses[0],
        "reference_last": evidence.reference_losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("overrides", nargs="*", help="extra overrides for every config")
    args = parser.parse_args()
    print(f"# bench_drift: {benchlib.now()}, {benchlib.machine()}")
    print(f"# {benchlib.command_line()}")
    print("\n| model | configuration | loss_drift | guard | reference loss (step 1 -> K) |")
    print("|---|---|---|---|---|")
    rows = []
    for model in args.models:
        for label, overrides in variants(args.global_batch):
            row = {"model": model, "configuration": label}
            row.update(check([f"model={model}", "device=cpu", *overrides, *args.overrides]))
            rows.append(row)
            verdict = "pass" if row["passed"] else f"infeasible (> {row['tolerance']:g})"
            skipped = f", {row['skipped_steps']} skipped" if row["skipped_steps"] else ""
            print(
                f"| {model} | {label} | {row['loss_drift']:.2e} | {verdict}{skipped} | "
                f"{row['reference_first']:.4f} -> {row['reference_last']:.4f} ({row['steps']} steps) |",
                flush=True,
            )
    if args.json:
        benchlib.write_json(args.json, {"machine": benchlib.machine(), "rows": rows})


if __name__ == "__main__":
    main()
