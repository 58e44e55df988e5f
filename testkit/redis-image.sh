#!/usr/bin/env bash
# Builds the local Docker image used by the e2e tests' Redis fixture (testcontainers path).
#
# No container registry is reachable, so the image is assembled FROM scratch out of Debian's
# redis-server binary plus exactly the shared libraries `ldd` reports for it.
# Idempotent: returns at once when the image already exists (set AI_LB_REDIS_REBUILD=1 to force).
#
# Usage: testkit/redis-image.sh [image-name]   (default: $AI_LB_REDIS_IMAGE or ai-lb-redis:local)
set -euo pipefail

IMAGE="${1:-${AI_LB_REDIS_IMAGE:-ai-lb-redis:local}}"

if ! command -v docker >/dev/null 2>&1; then
    echo "redis-image.sh: docker CLI not found" >&2
    exit 1
fi
if ! docker info >/dev/null 2>&1; then
    echo "redis-image.sh: Docker engine not reachable (docker info failed)" >&2
    exit 1
fi

if [ "${AI_LB_REDIS_REBUILD:-0}" != "1" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "redis-image.sh: image $IMAGE already present"
    exit 0
fi

if ! command -v redis-server >/dev/null 2>&1; then
    echo "redis-image.sh: installing Debian's redis-server"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq redis-server >/dev/null 2>&1 || {
        apt-get update -qq
        apt-get install -y -qq redis-server
    }
fi

# Resolve the symlink chain (Debian ships redis-server as a link to redis-check-rdb; the binary
# picks its role from argv[0], so it is copied under the name redis-server).
BIN="$(readlink -f "$(command -v redis-server)")"

CTX="$(mktemp -d)"
trap 'rm -rf "$CTX"' EXIT
mkdir -p "$CTX/rootfs/usr/bin" "$CTX/rootfs/tmp" "$CTX/rootfs/data"
cp -L "$BIN" "$CTX/rootfs/usr/bin/redis-server"

# Every library ldd lists (including the dynamic loader itself), at its original absolute path.
ldd "$BIN" | grep -oE '/[^ ]+' | sort -u | while read -r lib; do
    [ -e "$lib" ] || continue
    mkdir -p "$CTX/rootfs$(dirname "$lib")"
    cp -L "$lib" "$CTX/rootfs$lib"
done

cat >"$CTX/Dockerfile" <<'EOF'
FROM scratch
COPY rootfs/ /
WORKDIR /data
EXPOSE 6379
# No persistence: tests want a clean, fast server; logs go to stdout so readiness can be detected
# from the "Ready to accept connections" line.
CMD ["/usr/bin/redis-server", "--protected-mode", "no", "--bind", "0.0.0.0", "--port", "6379", "--save", "", "--appendonly", "no", "--dir", "/data"]
EOF

echo "redis-image.sh: building $IMAGE from $BIN"
# The classic builder needs no network and no base image; BuildKit may not be installed.
DOCKER_BUILDKIT=0 docker build -q -t "$IMAGE" "$CTX" >/dev/null
echo "redis-image.sh: built $IMAGE"
