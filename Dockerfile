# Atlas + Steerling image. CPU by default; GPU: --build-arg EXTRA=gpu --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG EXTRA=cpu
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    ATLAS_VENV=/opt/atlas/venv PATH=/opt/atlas/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends build-essential git make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# Dependencies first (cached layer), then the source.
COPY pyproject.toml README.md ./
COPY scripts/setup.sh scripts/setup.sh
COPY atlas atlas
COPY model model
COPY pipelines pipelines
RUN ATLAS_EXTRA=${EXTRA} bash scripts/setup.sh
COPY . .
# Ray head or worker is chosen by the command (see infra/).
CMD ["atlas", "--help"]
