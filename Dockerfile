# syntax=docker/dockerfile:1
# One image for the meshrun service AND every Ray node (head and workers), so Ray Train workers import the
# same meshrun `workers/` code, torch and ray versions as the service.
#
#   CPU (default):  docker build -t meshrun:cpu .
#   NVIDIA GPUs:    docker build -t meshrun:cu128 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                   (the CUDA wheel bundles the CUDA runtime; the host needs the NVIDIA driver and the
#                   NVIDIA Container Toolkit; run with `--gpus all` or deploy/compose.gpu.yml)
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MESHRUN_DATA_DIR=/var/lib/meshrun

# curl: health checks; procps: ps/pgrep for debugging inside the container.
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl procps \
 && rm -rf /var/lib/apt/lists/*

# torch first, from the PyTorch index (CPU wheel by default), so pip never pulls a CUDA build from PyPI.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/meshrun

# Dependencies in their own layer (a code change does not reinstall ray), exactly as locked: the versions CI
# tested, with hashes (torch, installed above, is left out of the lock). Every node of a Ray cluster must run
# the same Ray (and Python) version: the lock pins it (ray 2.60.0).
COPY requirements/runtime.lock ./requirements/runtime.lock
RUN pip install --require-hashes -r requirements/runtime.lock

# The project itself.
COPY pyproject.toml ./
COPY README.md ./
COPY api ./api
COPY service ./service
COPY workers ./workers
COPY migrations ./migrations
COPY examples ./examples
RUN pip install --no-deps . \
 && python -c "import api, service, workers, migrations, torch, ray; print('meshrun image ok: torch', torch.__version__, 'ray', ray.__version__)"

# Unprivileged user; directories that compose mounts named volumes on are created here so the volumes
# inherit this ownership.
RUN useradd --create-home --uid 1000 meshrun \
 && mkdir -p /var/lib/meshrun /data/checkpoints /tmp/ray \
 && chown -R meshrun:meshrun /var/lib/meshrun /data /tmp/ray
USER meshrun

EXPOSE 8000
# The service by default (listening beyond loopback turns token auth on); Ray nodes override the command
# (`ray start ... --block`), see docker-compose.yml.
ENV MESHRUN_HOST=0.0.0.0 MESHRUN_PORT=8000
CMD ["meshrun", "serve"]
