# Atlas + Steerling image. CPU by default; GPU:
#   docker build --build-arg EXTRA=gpu --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 -t atlas-steerling:gpu .
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG EXTRA=cpu
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    ATLAS_VENV=/opt/atlas/venv ATLAS_MODEL_CACHE=/opt/atlas/models PATH=/opt/atlas/venv/bin:$PATH
# The CUDA base images carry no Python: install the distribution's (3.12 on Ubuntu 24.04) with
# venv support when the base has none; the python:* base keeps its own.
RUN apt-get update && apt-get install -y --no-install-recommends build-essential git make ca-certificates \
    && if ! command -v python3 >/dev/null 2>&1; then \
         apt-get install -y --no-install-recommends python3 python3-venv python3-dev; fi \
    && python3 -m venv --help >/dev/null \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# Dependencies first (cached layer), then the source.
COPY pyproject.toml README.md ./
COPY scripts/setup.sh scripts/setup.sh
COPY atlas atlas
COPY model model
COPY pipelines pipelines
RUN ATLAS_EXTRA=${EXTRA} bash scripts/setup.sh
# Both packaged models prepared at build time, so no node converts them at run time
# (a node without them prepares them itself: engine actors resolve embedded: specs locally).
RUN HF_HUB_OFFLINE=1 atlas prepare-model gemma3-270m smollm2-135m-instruct
COPY . .
# Ray head or worker is chosen by the command (see infra/).
CMD ["atlas", "--help"]
