#!/usr/bin/env bash
# `make image`: build the CPU services image with buildah, with no registry: the base image is a
# Debian bookworm rootfs made by debootstrap and committed FROM scratch, then docker/services.Dockerfile
# builds on it (BASE=localhost/baton-base:bookworm). Then a smoke test runs the image's entry points.
#
#   IMAGE=localhost/baton-services:dev bash docker/build-image.sh
#   DOCKERFILE=docker/worker.Dockerfile IMAGE=localhost/baton-worker:cpu \
#     EXTRA_BUILD_ARGS="--build-arg TORCH_SPEC=torch==2.13.0" bash docker/build-image.sh
#
# buildah runs rootless-style here (--isolation chroot --storage-driver vfs): no daemon, no overlay.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/baton-services:0.1.0}
DOCKERFILE=${DOCKERFILE:-docker/services.Dockerfile}
BASE_IMAGE=${BASE_IMAGE:-localhost/baton-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WHEELS=${WHEELS:-/opt/wheels}          # extra local wheels (e.g. CPU torch), bind-mounted if present
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
WORK=${WORK:-/var/tmp/baton-image}
BUILDAH=(buildah --storage-driver vfs)

if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q && apt-get install -y -q buildah debootstrap
fi

if ! "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "== base image $BASE_IMAGE from debootstrap ($SUITE, minbase)"
    rm -rf "$WORK/rootfs" && mkdir -p "$WORK"
    debootstrap --variant=minbase "$SUITE" "$WORK/rootfs" "$MIRROR"
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
    ctr=$("${BUILDAH[@]}" from scratch)
    "${BUILDAH[@]}" copy "$ctr" "$WORK/rootfs/" /
    "${BUILDAH[@]}" config --cmd /bin/bash "$ctr"
    "${BUILDAH[@]}" commit --rm "$ctr" "$BASE_IMAGE"
    rm -rf "$WORK/rootfs"
fi

build_args=(--build-arg "BASE=$BASE_IMAGE")
volumes=()
if [ -d "$WHEELS" ]; then
    build_args+=(--build-arg PIP_FIND_LINKS=/wheels)
    volumes+=(--volume "$WHEELS:/wheels:ro")
fi
# The host's CA bundle, so pip inside the build trusts what the host trusts (e.g. a proxy's CA).
if [ -f "$HOST_CA" ]; then
    build_args+=(--build-arg PIP_CERT=/host-ca.crt)
    volumes+=(--volume "$HOST_CA:/host-ca.crt:ro")
fi
# The context is the committed tree (GIT_REF), never the working tree's uncommitted edits.
GIT_REF=${GIT_REF:-HEAD}
rm -rf "$WORK/context" && mkdir -p "$WORK/context"
git archive "$GIT_REF" | tar -x -C "$WORK/context"
echo "== $IMAGE from $DOCKERFILE at $(git rev-parse --short "$GIT_REF")"
# shellcheck disable=SC2086 # EXTRA_BUILD_ARGS is a list of flags
"${BUILDAH[@]}" bud --isolation chroot --ignorefile docker/services.dockerignore \
    "${build_args[@]}" "${volumes[@]}" ${EXTRA_BUILD_ARGS:-} -f "$DOCKERFILE" -t "$IMAGE" "$WORK/context"

echo "== smoke test"
ctr=$("${BUILDAH[@]}" from "$IMAGE")
trap '"${BUILDAH[@]}" rm "$ctr" >/dev/null' EXIT
run() { "${BUILDAH[@]}" run --isolation chroot "$ctr" -- "$@"; }
run id -u | grep -qx 10001
run python -c 'import sys; sys.modules["torch"] = None
import services.gateway.__main__, scheduler.adapters.main, services.safety.main, services.billing.__main__
from services.gateway.config import resolve_model_dir; print("default model:", resolve_model_dir(None))'
# The scheduler's entry point serves until the timeout's SIGTERM, then drains and exits.
run timeout 15 python -m scheduler.adapters --port 50070 --metrics-port 9090 --drain-grace-s 0 \
    > "$WORK/smoke.log" 2>&1 || true
cat "$WORK/smoke.log"
grep -q "compiled decision path) listening on" "$WORK/smoke.log"
"${BUILDAH[@]}" images "$IMAGE"
echo "== ok: $IMAGE"
