#!/usr/bin/env bash
# One short check on a lent GPU machine (e.g. NVIDIA H200): the GPU tests, the speedup over PyTorch
# defaults (bench_speedup.py), gpuopt's throughput versus an independent timing (bench_agreement.py)
# and a small sweep, all on CUDA. Everything it writes lands directly under $OUT (7 files):
#   check.log  env.json  pytest_gpu.txt  speedup.json  agreement.json  sweep_summary.txt  sweep_results.yaml
#
#   OUT=/some/dir bash scripts/gpu_check.sh            # from the repository root (or anywhere)
#
# Needs a Python whose torch sees CUDA, and gpuopt's other dependencies (hydra-core, optuna, ...).
# The machine has no network: if gpuopt does not import, the script installs it with
# `pip install --no-index --find-links $GPUOPT_WHEELS` (default ./.gpu_wheels, made beforehand with
# `pip download -d .gpu_wheels ".[lightning]"` minus torch, and carried along) or stops with a clear
# message. Each step has a time limit; the whole script stays under ~9 minutes.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
LOG="$OUT/check.log"
PY="${PYTHON:-python3}"
WHEELS="${GPUOPT_WHEELS:-.gpu_wheels}"
status=0

say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
# step NAME SECONDS CMD...: run with a time limit, log its output, remember a failure, go on.
step() {
    local name="$1" limit="$2"; shift 2
    say "$name: $*"
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        say "$name: FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', time limit'))"
        status=1
    else
        say "$name: ok"
    fi
}

say "start; load $(cut -d' ' -f1-3 /proc/loadavg)"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    say "STOP: $PY has no torch. Install a CUDA build of torch (e.g. pip install torch==2.13.0) first."
    exit 3
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "STOP: torch $("$PY" -c 'import torch; print(torch.__version__)') does not see a CUDA device" \
        "(torch.cuda.is_available() is False): a CPU-only build, or no driver. Nothing to check here."
    exit 3
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee -a "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version,utilization.gpu --format=csv >>"$LOG" 2>&1

if ! "$PY" -c "import gpuopt.run, hydra, optuna" >/dev/null 2>&1; then
    if [ -d "$WHEELS" ]; then
        say "gpuopt does not import: installing from $WHEELS (no network)"
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-build-isolation -e ".[dev,lightning]" >>"$LOG" 2>&1
    fi
    if ! "$PY" -c "import gpuopt.run, hydra, optuna" >>"$LOG" 2>&1; then
        say "STOP: gpuopt or its dependencies do not import and cannot be installed offline" \
            "(no $WHEELS). Carry a wheel folder: pip download -d .gpu_wheels '.[dev,lightning]' (without torch)."
        exit 4
    fi
fi

"$PY" -m gpuopt.env --json >"$OUT/env.json" 2>>"$LOG" || say "gpuopt.env failed (see check.log)"

# 1. The GPU tests (skipped without CUDA elsewhere; here they must run).
say "pytest -m gpu"
timeout --kill-after=10 180 "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider >"$OUT/pytest_gpu.txt" 2>&1
rc=$?
tail -3 "$OUT/pytest_gpu.txt" | tee -a "$LOG"
[ "$rc" -eq 0 ] || { say "pytest -m gpu: FAILED (exit $rc)"; status=1; }

# 2. Speedup over PyTorch defaults on CUDA: one transformer (matmul-bound: precision matters on a
#    GPU), a short default sweep, two interleaved rounds.
step speedup 240 "$PY" scripts/bench_speedup.py --models transformer --device cuda --trials 6 \
    --repeats 2 --window-s 3 --json "$OUT/speedup.json"

# 3. Agreement of gpuopt's throughput with a plain synchronized loop and torch.utils.benchmark.
step agreement 150 "$PY" scripts/bench_agreement.py --models cnn --device cuda --rounds 3 --steps 100 \
    --json "$OUT/agreement.json"

# 4. A small sweep of the precision preset (grid over fp32, tf32, fp16, bf16) on CUDA.
SWEEP_DIR="$(mktemp -d)"
step sweep 150 "$PY" -m gpuopt.run -m search=precision model=cnn device=cuda measure=quick \
    "output_dir=$SWEEP_DIR" "hydra.sweep.dir=$SWEEP_DIR/sweep"
cp "$SWEEP_DIR/sweep/summary.txt" "$OUT/sweep_summary.txt" 2>/dev/null || say "sweep: no summary.txt"
cp "$SWEEP_DIR/sweep/optimization_results.yaml" "$OUT/sweep_results.yaml" 2>/dev/null || true
rm -rf "$SWEEP_DIR"

say "done (status $status); load $(cut -d' ' -f1-3 /proc/loadavg)"
exit "$status"
