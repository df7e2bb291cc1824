#!/usr/bin/env bash
# Make a local Debian bookworm base image with debootstrap + `docker import`.
#
# Why: CI machines reach Debian and PyPI but no container registry, so the recipe's base
# (docker.io/library/debian:bookworm-slim) cannot be pulled there. A minbase bootstrap of the
# same release is the closest local stand-in: every layer above it is the one we ship.
#
# Usage: scripts/bootstrap_base_image.sh [IMAGE_NAME [ARCH]]   (default dsa-image-base:bookworm,
#        this machine's arch). Another ARCH (arm64 on an x86 host) needs qemu-user-static with
#        binfmt_misc registered: debootstrap's second stage runs the target's binaries.
# Idempotent: does nothing when IMAGE_NAME already exists. Exit 0 on success, 1 on failure.
set -euo pipefail

image="${1:-dsa-image-base:bookworm}"
arch="${2:-$(dpkg --print-architecture)}"
suite="bookworm"
mirror="http://deb.debian.org/debian"

use_it="bootstrap_base_image: build on it with BASE_IMAGE=$image docker buildx bake ... (python3 scripts/preflight.py prints the whole command)"
if docker image inspect "$image" >/dev/null 2>&1; then
    echo "bootstrap_base_image: $image already exists, keeping it"
    echo "$use_it"
    exit 0
fi
command -v debootstrap >/dev/null || {
    echo "bootstrap_base_image: debootstrap not found; install it: apt-get install -y debootstrap" >&2
    exit 1
}

rootfs="$(mktemp -d /tmp/dsa-image-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
# minbase without extra packages: like debian:bookworm-slim, the Dockerfile installs Python itself.
debootstrap --variant=minbase --arch="$arch" "$suite" "$rootfs" "$mirror"
# Like the official slim image: no apt lists or caches in the layer.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
if [[ "$arch" == "$(dpkg --print-architecture)" ]]; then
    tar -C "$rootfs" -c . | docker import -c 'CMD ["bash"]' -m "debootstrap --variant=minbase $suite $mirror" - "$image"
else
    # docker import (engine 20.10) records the host's architecture whatever --platform says, and
    # BuildKit then looks for the foreign one in a registry: build the image for its platform.
    context="$(mktemp -d /tmp/dsa-image-base-context.XXXXXX)"
    trap 'rm -rf "$rootfs" "$context"' EXIT
    tar -C "$rootfs" -cf "$context/rootfs.tar" .
    printf 'FROM scratch\nADD rootfs.tar /\nCMD ["bash"]\n' > "$context/Dockerfile"
    docker buildx build --platform "linux/$arch" --output type=docker -t "$image" "$context"
fi
echo "bootstrap_base_image: made $image"
echo "$use_it"
