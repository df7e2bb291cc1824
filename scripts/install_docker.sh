#!/usr/bin/env bash
# Install a Docker engine, buildx and debootstrap on a Debian bookworm CI machine, and start
# the daemon; each part is skipped when already present or running. As root.
#
# How and why (no bridge, buildx from sid, host networking): docs/image.md, "Getting Docker
# and buildx" and "Hosts without a registry, a bridge or direct TLS".
# Exit 0 when `docker info` and `docker buildx version` answer, 1 otherwise.
set -euo pipefail

log() { echo "install_docker: $*" >&2; }

apt_updated=""
apt_install() {
    if [[ -z "$apt_updated" ]]; then apt-get update -q; apt_updated=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

command -v dockerd >/dev/null || { log "installing docker.io"; apt_install docker.io; }
command -v debootstrap >/dev/null || { log "installing debootstrap"; apt_install debootstrap; }
python3 -c 'import ensurepip' 2>/dev/null || { log "installing python3-venv"; apt_install python3-venv; }

if ! docker buildx version >/dev/null 2>&1; then
    # bookworm has no buildx; sid's docker-buildx (>= 0.15 for bake's `network`) depends only on libc6.
    log "installing docker-buildx from Debian sid (one package, one-off source list)"
    work="$(mktemp -d)"
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: sid\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > "$work/sid.sources"
    mkdir -p "$work/lists/partial"
    sid=(-o "Dir::Etc::SourceList=$work/sid.sources" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$work/lists")
    apt-get "${sid[@]}" update -q
    (cd "$work" && apt-get "${sid[@]}" download docker-buildx)
    dpkg -i "$work"/docker-buildx_*.deb
    rm -rf "$work"
fi

if ! docker info >/dev/null 2>&1; then
    # No docker0 bridge and no iptables: builds and containers use host networking.
    log "starting dockerd (log: /var/log/dockerd.log)"
    nohup dockerd --bridge=none --iptables=false --ip6tables=false >/var/log/dockerd.log 2>&1 &
    for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info >/dev/null 2>&1 || { log "dockerd did not answer within 60 s; see /var/log/dockerd.log"; tail -20 /var/log/dockerd.log >&2; exit 1; }
log "$(docker version --format 'engine {{.Server.Version}}'), $(docker buildx version)"
if ! docker network inspect bridge >/dev/null 2>&1; then
    # A default build on this engine fails with "network bridge not found".
    log "this engine has no docker0 bridge: bake with BUILD_NETWORK=host and --allow network.host" \
        "(python3 scripts/preflight.py prints the whole command; docs/image.md, \"Hosts without a registry, a bridge or direct TLS\")"
fi
