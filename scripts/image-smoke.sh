#!/usr/bin/env bash
# The image alone, as `docker run IMAGE` starts it (its CMD: `gapserve serve`): the
# container gets no network but its own loopback (--network none), so it reaches
# nothing and nothing reaches it; the checks run inside it (`docker exec`, Python's
# standard library): every service ready, one greedy chat completion whose answer
# names Paris, the same answer a second time, then the container's memory. The
# container is removed on every exit.
#
#   scripts/image-smoke.sh [IMAGE]          # default gapserve:latest
#   docker image ls IMAGE; docker history IMAGE   # its size, layer by layer
#
# Exits 0 without doing anything only where no container engine is reachable, and
# says so (SKIPPED). A missing image, a start that is not ready within
# GAPSERVE_IMAGE_SMOKE_TIMEOUT seconds (default 600) or a wrong answer exit 1.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${1:-gapserve:latest}
TIMEOUT=${GAPSERVE_IMAGE_SMOKE_TIMEOUT:-600}
if ! docker info >/dev/null 2>&1; then
  echo "image-smoke: SKIPPED: no container engine reachable (docker info failed)"
  exit 0
fi
if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "image-smoke: FAILED: no image $IMAGE (docker build -t $IMAGE .)"
  exit 1
fi

NAME=gapserve-image-smoke-$$
cleanup() {
  local rc=$?
  if [ "$rc" != 0 ]; then
    echo "--- container log tail (failure) ---"
    docker logs --tail 40 "$NAME" 2>&1 || true
  fi
  docker rm -f "$NAME" >/dev/null 2>&1 || true
  echo "image-smoke: $([ "$rc" = 0 ] && echo PASSED || echo FAILED)"
}
trap cleanup EXIT

size=$(docker image inspect "$IMAGE" --format '{{.Size}}')
echo "== $IMAGE: $(awk -v b="$size" 'BEGIN {printf "%.2f GB", b / 1e9}')"
t0=$SECONDS
docker run -d --name "$NAME" --network none "$IMAGE" >/dev/null
echo "== started; waiting for ready (at most $TIMEOUT s)"
docker exec -i "$NAME" python - "$TIMEOUT" < scripts/image_smoke_client.py
echo "ready and answered $((SECONDS - t0)) s after docker run"
docker stats --no-stream --format 'memory: {{.MemUsage}}' "$NAME"
