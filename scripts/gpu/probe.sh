#!/usr/bin/env bash
# GPU machine probe (scripts/gpu/NOTES.md). On the device, from the repository root, with the bundle carried:
#   bash .gpubundle/probe.sh        (PROBE_SECTIONS=env,ray,... to run some sections only)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/probe-out}"
mkdir -p "$OUT"
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$B/bundle_setup.sh" || exit 1
cp "${MESHRUN_GPU_DIR:-/tmp/meshrun-gpu}/resolve.txt" "$OUT/" 2>/dev/null
python3 "$B/probe.py" "$OUT" 2>&1 | tee "$OUT/probe.log"
