#!/usr/bin/env bash
# Build the offline Python bundle that lets meshrun (torch engine + service + local Ray head) run on the lent
# GPU machine, which has no network and whose image lacks Ray, FastAPI, SQLAlchemy, pydantic, ...
#
#   scripts/gpu/build_bundle.sh [OUTDIR]      (default: <repository root>/.gpubundle, git-ignored)
#
# OUTDIR/site.tar.xz holds, for CPython 3.12 manylinux x86_64:
#   site/               the packages of bundle-lock.txt (what the image lacks), Ray pruned (no jars, rllib,
#                       llm, tests; binaries stripped); put it first on PYTHONPATH
#   fallback/<name>/    one folder per package of fallback-lock.txt (the image has them); bundle_resolve.py
#                       copies one into site/ only where the image's version does not satisfy a requirement
#   (sources *.c/*.pyx and virtualenv's embedded seed wheels dropped too)
# plus the scripts that install it there (bundle_setup.sh, bundle_resolve.py) and the probe. On the device:
#   . .gpubundle/bundle_setup.sh      (extracts to /tmp/site, resolves, exports PYTHONPATH and PATH)
# Needs here: pip with access to a package index, xz, strip. Takes a few minutes (xz -9).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(git -C "$HERE" rev-parse --show-toplevel)"
OUTDIR="${1:-$ROOT/.gpubundle}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/gpubundle-XXXX)"
trap 'rm -rf "$WORK"' EXIT

PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312)
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
         manylinux_2_35_x86_64; do
  PLAT+=(--platform "$p")
done

echo "== downloading wheels (CPython 3.12, manylinux x86_64)"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/wheels" \
  -r "$HERE/bundle-lock.txt" -r "$HERE/fallback-lock.txt"

install() {  # target, requirement lines...
  local target="$1"; shift
  "$PY" -m pip install -q --no-index --find-links "$WORK/wheels" --no-deps --no-compile "${PLAT[@]}" \
    --target "$target" "$@" 2>&1 | grep -v "Running pip as the 'root' user" || true
}

echo "== installing bundle packages into site/"
mapfile -t BUNDLE < <(grep -v '^#' "$HERE/bundle-lock.txt" | grep .)
install "$WORK/stage/site" "${BUNDLE[@]}"
echo "== installing fallback packages, one folder each"
while read -r req; do
  install "$WORK/stage/fallback/${req%%==*}" "$req"
done < <(grep -v '^#' "$HERE/fallback-lock.txt" | grep .)

echo "== pruning"
RAY="$WORK/stage/site/ray"
test -f "$RAY/_raylet.so" || { echo "ray missing from the stage" >&2; exit 1; }
rm -rf "$RAY/jars" "$RAY/rllib" "$RAY/llm"
find "$WORK/stage" -type d \( -name tests -o -name __pycache__ \) -prune -exec rm -rf {} +
find "$WORK/stage" -type f \( -name '*.c' -o -name '*.pyx' \) -delete
# virtualenv's seed wheels (pip, setuptools) only serve runtime_env pip installs, which need a network anyway
rm -f "$WORK/stage/site/virtualenv/seed/wheels/embed/"*.whl
strip --strip-unneeded "$RAY/_raylet.so" "$RAY/core/src/ray/gcs/gcs_server" "$RAY/core/src/ray/raylet/raylet"
# console scripts were written with this machine's interpreter in their shebang: use the device's python3
find "$WORK/stage" -path '*/bin/*' -type f | while read -r f; do
  if head -c2 "$f" | grep -q '#!'; then sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$f"; fi
done

echo "== compressing (xz -9)"
mkdir -p "$OUTDIR"
rm -f "$OUTDIR/site.tar.xz"
tar -C "$WORK/stage" -cf - site fallback | xz -9 -T2 > "$OUTDIR/site.tar.xz"
cp "$HERE/bundle_setup.sh" "$HERE/bundle_resolve.py" "$HERE/probe.sh" "$HERE/probe.py" "$HERE/probe_job.py" \
  "$HERE/bundle-lock.txt" "$HERE/fallback-lock.txt" "$OUTDIR/"
du -b "$OUTDIR"/* | sort -n
echo "bundle: $OUTDIR ($(du -sb "$OUTDIR" | cut -f1) bytes); carry its repository-relative path"
