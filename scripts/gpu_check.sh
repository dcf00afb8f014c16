#!/usr/bin/env bash
# One prepared check on a lent GPU machine (an NVIDIA H200: one GPU, 16 host cores, no network),
# in under ~8 minutes (one device run is capped at 600 s). Steps, most valuable first, each with its
# own time limit and all under one overall deadline (a step that no longer fits is skipped):
#   1. pytest -m gpu (tests/test_gpu.py: clocks, NVML, precisions, OOM, pinning, MFU)
#   2. MFU: a matmul-bound MLP (width 8192) in fp32, tf32 and bf16, and a GPT (width 1024, depth 12)
#      in bf16: end-to-end MFU and compute-only MFU (ceiling throughput) against the documented peak;
#      util.gpu beside GPM's SM, tensor-core and DRAM activity for each, and for the launch-bound
#      default mlp at micro-batch 32 (summary.json's `utilizations`)
#   3. agreement of gpuopt's throughput with a plain loop with identical flags (the GPT, bf16)
#   4. a default sweep of a CNN with a CPU-heavy loader (16 host cores): speedup over PyTorch defaults;
#      its baseline's and best's util.gpu, GPM metrics and MFU (speedup.json's `utilizations`)
# Everything lands directly under $OUT (7 files, all small):
#   check.log  env.json  pytest_gpu.txt  mfu.json  agreement.json  speedup.json  summary.json
#
#   bash scripts/fetch_gpu_wheels.sh                      # here, once: the wheels into .whl/
#   device run, carry [".whl"]:  OUT=$OUT bash scripts/gpu_check.sh
#
# The device image has torch but not gpuopt's other dependencies: the wheels of GPU_WHEELS are
# installed first with the device README's recipe (pip --no-index --no-deps --target /tmp/site),
# then gpuopt itself (editable, no build isolation: Hydra finds its plugins through entry points).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
LOG="$OUT/check.log"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
STEPS="$WORK/steps.tsv"
START_S=$SECONDS
DEADLINE_S="${GPU_CHECK_DEADLINE_S:-465}"  # seconds after start; one device run is capped at 600
status=0
export PYTHONUNBUFFERED=1

# What the image lacks (scripts/fetch_gpu_wheels.sh downloads exactly these; keep both in step).
# Present there already: torch, numpy, PyYAML, cloudpickle, typing-extensions, tqdm, packaging,
# rich, MarkupSafe, nvidia-ml-py, pytest, lightning.
GPU_WHEELS="hydra-core hydra-optuna-sweeper hydra-submitit-launcher omegaconf optuna alembic Mako
SQLAlchemy colorlog submitit"

say() { echo "[gpu_check $(date +%H:%M:%S) +$((SECONDS - START_S))s] $*" | tee -a "$LOG"; }
# step NAME SECONDS CMD...: run with a time limit (cut to the overall deadline), log its output,
# record (name, exit code, seconds) in $STEPS, go on.
step() {
    local name="$1" limit="$2"; shift 2
    local left=$((DEADLINE_S - (SECONDS - START_S)))
    if [ "$left" -lt 30 ]; then
        say "$name: SKIPPED (${left}s left before the deadline)"
        printf '%s\tskipped\t0\n' "$name" >>"$STEPS"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "$name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$STEPS"
    if [ "$rc" -ne 0 ]; then
        say "$name: FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', time limit'))"
        status=1
    else
        say "$name: ok ($((SECONDS - t0))s)"
    fi
}

say "start; load $(cut -d' ' -f1-3 /proc/loadavg)"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$LOG" 2>&1; then
    say "STOP: $PY has no torch that sees a CUDA device. Nothing to check here."
    exit 3
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee -a "$LOG"
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,power.limit --format=csv >>"$LOG" 2>&1

# ---- dependencies: carried wheels, then gpuopt itself ------------------------------------------
if ls .whl/*.whl >/dev/null 2>&1; then
    say "installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || say "wheel install failed (see check.log)"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    say "no .whl/ (run scripts/fetch_gpu_wheels.sh here and carry .whl): expecting $GPU_WHEELS installed"
fi
has_plugin='from importlib.metadata import entry_points as e; import sys; sys.exit(0 if any(p.name == "gpuopt_sweeper" for p in e(group="hydra.plugins")) else 1)'
if ! "$PY" -c "$has_plugin" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 \
        || say "editable install of gpuopt failed (see check.log)"
fi
if ! "$PY" -c "import gpuopt.run, gpuopt.sweeper.plugin, hydra, optuna, submitit" >>"$LOG" 2>&1 \
    || ! "$PY" -c "$has_plugin"; then
    say "STOP: gpuopt or its dependencies do not import (missing one of: $GPU_WHEELS)"
    exit 4
fi
"$PY" -m gpuopt.env --json >"$OUT/env.json" 2>>"$LOG" || say "gpuopt.env failed (see check.log)"

# ---- 1. the GPU tests ----------------------------------------------------------------------------
# Only the files that hold gpu-marked tests: collecting the whole suite imports optional extras.
mapfile -t GPU_TEST_FILES < <(grep -l "pytest.mark.gpu" tests/test_*.py)
say "pytest -m gpu ${GPU_TEST_FILES[*]}"
t0=$SECONDS
timeout --kill-after=10 170 "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider "${GPU_TEST_FILES[@]}" \
    >"$OUT/pytest_gpu.txt" 2>&1
rc=$?
printf 'pytest_gpu\t%s\t%s\n' "$rc" "$((SECONDS - t0))" >>"$STEPS"
tail -3 "$OUT/pytest_gpu.txt" | tee -a "$LOG"
case "$rc" in
    0) say "pytest -m gpu: ok" ;;
    5) say "pytest -m gpu: NO TESTS COLLECTED (exit 5): not a failure of the code, but nothing was checked" ;;
    *) say "pytest -m gpu: FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', time limit'))"; status=1 ;;
esac

# ---- 2. MFU on GPU-sized workloads ---------------------------------------------------------------
# A matmul-bound MLP (5 hidden 8192x8192 layers, ~2 GFLOP/sample) fed by 12 loader workers, and
# a GPT (width 1024, depth 12, 1024 tokens, vocabulary 8192). Short windows; the ceiling replays
# one on-device batch (compute only).
MLP=(model=mlp model.width=8192 model.depth=6 "model.input_shape=[1024]" loader.batch_size=2048
     loader.num_workers=12 loader.pin_memory=true loader.non_blocking=true
     loader.persistent_workers=true data.sample_cost=0 data.size=65536)
GPT=(model=transformer model.width=1024 model.depth=12 model.heads=16 "model.input_shape=[1024]"
     model.num_classes=8192 loader.batch_size=16 loader.num_workers=4 loader.pin_memory=true
     loader.non_blocking=true data.sample_cost=0 data.size=4096)
WINDOW=(device=cuda measure.warmup_steps=5 measure.time_budget_s=3 measure.min_time_s=1
        measure.max_steps=400 measure.ceiling_steps=20)
mfu_run() {  # mfu_run NAME OVERRIDES...: one trial, its result.json kept as $WORK/mfu/NAME.json
    local name="$1"; shift
    "$PY" -m gpuopt.run "$@" "${WINDOW[@]}" "hydra.run.dir=$WORK/run_$name" "output_dir=$WORK/run_$name" \
        && cp "$WORK/run_$name/result.json" "$WORK/mfu/$name.json"
}
mkdir -p "$WORK/mfu"
for mode in fp32 tf32 bf16; do
    step "mfu_mlp_$mode" 40 mfu_run "mlp_$mode" "${MLP[@]}" "precision=$mode"
done
step mfu_gpt_bf16 50 mfu_run gpt_bf16 "${GPT[@]}" precision=bf16
# The two utilizations apart (docs/measuring.md#two-utilizations): the default mlp at micro-batch
# 32, launch-bound (util.gpu high, few SMs busy), beside the 8192-wide fp32 one above (SMs busy,
# tensor cores idle at fp32) and bf16 (tensor cores busy). GPM's metrics land in mfu.json.
step util_mlp_b32 30 mfu_run mlp_b32 model=mlp loader.batch_size=32 precision=bf16

# ---- 3. agreement with a plain loop with identical flags (the GPT in bf16) -----------------------
step agreement 110 "$PY" scripts/bench_agreement.py --models transformer --device cuda --rounds 2 \
    --steps 60 --warmup 5 --json "$OUT/agreement.json" \
    "${GPT[@]}" loader.num_workers=0 precision=bf16 device.num_threads=null

# ---- 4. a default sweep of a CNN with a CPU-heavy loader: speedup over PyTorch defaults ----------
# 0.4 ms of CPU work per sample: batch 256 costs ~100 ms on one core, ~7 ms on 16 workers.
step speedup 170 "$PY" scripts/bench_speedup.py --models cnn --device cuda --trials 6 --repeats 2 \
    --window-s 2 --json "$OUT/speedup.json" model.width=64 data.sample_cost=4

# ---- summary --------------------------------------------------------------------------------------
"$PY" - "$WORK" "$OUT" >>"$LOG" 2>&1 <<'EOF'
import json, sys
from pathlib import Path

from gpuopt.core.metrics import METRICS
from gpuopt.trial.measure import peak_flops

GPM = [metric.name for metric in METRICS if metric.gpm]  # sm_active, ..., beside util.gpu

work, out = Path(sys.argv[1]), Path(sys.argv[2])
steps = [line.split("\t") for line in (work / "steps.tsv").read_text().splitlines() if line]
mfu = {}
for path in sorted((work / "mfu").glob("*.json")):
    result = json.loads(path.read_text())
    m, env = result.get("metrics") or {}, result.get("env") or {}
    mode = (result.get("config") or {}).get("precision", {}).get("mode")
    peak = peak_flops(env.get("device_name"), mode) if mode else None
    ceiling = m.get("ceiling_throughput")
    flops = m.get("flops_per_sample")
    mfu[path.stem] = {
        "status": result.get("status"),
        "reason": result.get("reason"),
        "precision": mode,
        "peak_tflops": peak / 1e12 if peak else None,
        "mfu": m.get("mfu"),
        "mfu_compute_only": 100 * flops * ceiling / peak if peak and flops and ceiling else None,
        **{k: m.get(k) for k in ("throughput", "ceiling_throughput", "flops_per_sample",
                                 "step_time_ms", "data_wait", "utilization", "power_w",
                                 "energy_per_sample_j", "peak_memory_mb", "timed_steps",
                                 "stop_reason", "compute_dtype")},
        **{k: m.get(k) for k in GPM},
        "warnings": result.get("warnings"),
    }
(out / "mfu.json").write_text(json.dumps(mfu, indent=1))
pytest_tail = (out / "pytest_gpu.txt").read_text().strip().splitlines()[-1:] if (out / "pytest_gpu.txt").exists() else []
summary = {
    "steps": [{"name": n, "exit": rc, "seconds": int(s)} for n, rc, s in steps],
    "pytest_gpu": pytest_tail[0] if pytest_tail else None,
    "mfu": {k: {"mfu": v["mfu"], "mfu_compute_only": v["mfu_compute_only"], "status": v["status"]}
            for k, v in mfu.items()},
    # util.gpu and SM activity apart: each run's two utilizations, its GPM metrics and MFU
    "utilizations": {k: {"utilization": v["utilization"], **{g: v[g] for g in GPM},
                         "mfu": v["mfu"], "gpm_warnings": [w for w in v["warnings"] or []
                                                           if "GPM" in w]}
                     for k, v in mfu.items()},
}
for name in ("agreement", "speedup", "env"):
    path = out / f"{name}.json"
    if path.exists():
        try:
            summary[name] = json.loads(path.read_text())
        except ValueError:
            summary[name] = "unreadable"
(out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
print(json.dumps(summary["steps"]), json.dumps(summary["mfu"]))
EOF
rm -rf "$WORK"
say "done (status $status, $((SECONDS - START_S))s); load $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$status"
