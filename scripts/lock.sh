#!/usr/bin/env bash
# Refresh the dependency locks that the README's two commands install (pip-tools, with hashes):
#   requirements/dev.lock      runtime + the dev/test extras (the test command and CI)
#   requirements/runtime.lock  runtime only (the first command), the same versions as dev.lock
# Both are resolved against torch as pinned in requirements/torch.txt and leave torch out: the README installs
# torch first (CPU wheel or CUDA build), so the locks fit either. Resolve with the CPU wheel reachable (this
# machine's pip finds it on disk; elsewhere PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu), or the
# CUDA build's nvidia-* packages land in the lock. tests/test_lock.py checks the locks against pyproject.toml.
#   bash scripts/lock.sh            newest versions that pyproject.toml allows
#   bash scripts/lock.sh --keep     re-resolve keeping today's pins where they still fit (after a pyproject edit)
set -euo pipefail
cd "$(dirname "$0")/.."
upgrade=(--upgrade)
[[ "${1:-}" == "--keep" ]] && upgrade=()
python -m pip install -q "pip-tools==7.6.2"
opts=(--quiet --generate-hashes --strip-extras --unsafe-package torch --no-emit-index-url --no-emit-find-links
      --constraint requirements/torch.txt)
python -m piptools compile "${opts[@]}" "${upgrade[@]}" --extra dev --output-file requirements/dev.lock pyproject.toml
cp requirements/dev.lock requirements/runtime.lock  # seeds the runtime resolve with dev.lock's versions
python -m piptools compile "${opts[@]}" --output-file requirements/runtime.lock pyproject.toml
echo "locks written: requirements/dev.lock requirements/runtime.lock"
