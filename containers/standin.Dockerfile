# CI's stand-in for the three real bases (python:3.11-slim, pytorch/pytorch, lmsysorg/sglang), none
# of which can be pulled on a machine without registry access. scripts/build-images.sh builds it
# FROM a Debian rootfs made locally with debootstrap and tags it with each base's full name, so
# `podman build --pull=never` runs every step of the real Dockerfiles on it.
#
# Like the real bases it has python3 with pip; like the two GPU bases it has torch in the system
# site-packages (the CPU wheel, from a mounted folder: WHEEL_DIR). It proves the Dockerfiles' own
# steps and the entrypoint wiring, not CUDA, NCCL or SGLang itself (see docs/CLUSTER.md).
ARG ROOTFS_IMAGE=localhost/eaglenest-rootfs:bookworm
FROM ${ROOTFS_IMAGE}

ARG WHEEL_DIR=/wheels

# Debian 12's python3 is externally managed (PEP 668); the real bases' pythons are not
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# versions come from the rootfs's own bookworm snapshot: the stand-in is rebuilt, never shipped
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s /usr/bin/python3 /usr/local/bin/python

COPY requirements/constraints.txt /tmp/constraints.txt
RUN python3 -m pip install --no-cache-dir --no-index --find-links "$WHEEL_DIR" -c /tmp/constraints.txt torch==2.13.0 \
 && python3 -c 'import torch; print("stand-in torch", torch.__version__)'
