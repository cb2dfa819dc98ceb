# Source this on the GPU machine from the repository root:   . .gpubundle/bundle_setup.sh
# Extracts the bundle (site.tar.xz beside this file) to $MESHRUN_GPU_DIR (default /tmp/meshrun-gpu) unless it is
# already there, completes it against the image (bundle_resolve.py), and exports PYTHONPATH (bundle site first,
# then the repository, so `python3 -m api.cli`, `-m workers`, `-m service...` import this checkout) and PATH.
# Returns non-zero (without exiting the caller's shell) when something is missing.
_mr_b="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_mr_repo="$(cd "$_mr_b/.." && pwd)"
_mr_d="${MESHRUN_GPU_DIR:-/tmp/meshrun-gpu}"
_mr_t0=$(date +%s.%N)
if [ ! -f "$_mr_d/.extracted" ] || [ "$(cat "$_mr_d/.extracted")" != "$(stat -c %s "$_mr_b/site.tar.xz")" ]; then
  rm -rf "$_mr_d" && mkdir -p "$_mr_d"
  if command -v xz >/dev/null 2>&1; then
    tar -C "$_mr_d" -xJf "$_mr_b/site.tar.xz"
  else
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$_mr_b/site.tar.xz" "$_mr_d"
  fi && env -u PYTHONPATH python3 "$_mr_b/bundle_resolve.py" "$_mr_d" "$_mr_repo" \
    && stat -c %s "$_mr_b/site.tar.xz" > "$_mr_d/.extracted"
fi
if [ -f "$_mr_d/.extracted" ]; then
  export PYTHONPATH="$_mr_d/site:$_mr_repo${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$_mr_d/site/bin:$PATH"
  export RAY_USAGE_STATS_ENABLED=0   # no network there
  echo "bundle: ready in $_mr_d ($(python3 -c "print(f'{$(date +%s.%N)-$_mr_t0:.1f}')") s)"
  true
else
  echo "bundle: extraction or resolution FAILED" >&2
  false
fi
