#!/usr/bin/env bash
# Download, into .whl/, the pure-Python wheels that gpuopt needs and the lent GPU machine's image
# lacks (it has torch, numpy, PyYAML, cloudpickle, typing-extensions, tqdm, packaging, rich,
# MarkupSafe, nvidia-ml-py, pytest and lightning, but none of these). Run it here, where pip
# reaches an index; the device has no network. scripts/gpu_check.sh installs them there with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# Each device call that needs them names `.whl` in `carry`. Keep the list in step with
# GPU_WHEELS in scripts/gpu_check.sh (one version of each: two stop the whole install).
#
#   bash scripts/fetch_gpu_wheels.sh          # from anywhere; writes <repo>/.whl/
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    hydra-core==1.4.0rc3
    hydra-optuna-sweeper==1.4.0rc3
    hydra-submitit-launcher==1.4.0rc3
    omegaconf==2.4.1rc1
    optuna==5.0.0
    alembic==1.20.1
    Mako==1.4.3
    SQLAlchemy==2.1.9
    colorlog==6.12.0
    submitit==1.5.4
)

# The folder travels with the tree but must never be committed.
exclude="$(git rev-parse --git-path info/exclude)"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
mkdir -p .whl
# The device's Python is CPython 3.12 on x86-64 (its README): match its tags, not this machine's.
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${WHEELS[@]}"
ls -1 .whl
du -sh .whl
