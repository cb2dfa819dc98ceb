#!/usr/bin/env bash
# meshrun's GPU check in one command, on a bare GPU machine with no network (the lent H100/H200 of the device tool,
# or any CUDA machine). From the repository root:
#
#   scripts/gpu_check.sh [OUT_DIR] [BUDGET_S]
#
# 1. Installs what the image lacks: on a machine where pip can reach PyPI, `pip install -e .` is enough; without a
#    network, carry the bundle built by scripts/gpu/build_bundle.sh as .gpubundle/ (ray, fastapi, sqlalchemy,
#    pydantic... for the image's Python, about 43 MB xz) and it is unpacked to /tmp/meshrun-gpu.
# 2. Runs scripts/gpu/check.py: env + measured matmul peak, the GPT presets in bf16 through meshrun's loop with the
#    planner's prediction beside each, the same 1B-class model through a minimal torch loop, loss parity on the GPU
#    (NCCL one rank; two ranks over gloo with CUDA tensors, since NCCL refuses two ranks on one GPU), the service
#    end to end (a run through REST on a local Ray head with the GPU), and torch.compile per block.
#    Results: OUT_DIR/gpu_check.json (written after every section) and a summary on stdout; docs/gpu-results.md
#    records them with the date and the device.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-/tmp/meshrun-gpu-check}"
BUDGET="${2:-900}"
if ! python3 -c "import ray, fastapi, sqlalchemy" 2>/dev/null; then
  if [ -f .gpubundle/bundle_setup.sh ]; then
    . .gpubundle/bundle_setup.sh || exit 1
  else
    python3 -m pip install -q -e . || { echo "install meshrun's dependencies (or carry .gpubundle)" >&2; exit 1; }
  fi
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader || true
python3 scripts/gpu/check.py --out "$OUT" --budget-s "$BUDGET" ${GPU_CHECK_ARGS:-}
