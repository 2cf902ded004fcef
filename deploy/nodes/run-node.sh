#!/usr/bin/env bash
# Start KVpop Serve on one GPU node (the main node and every worker node run the same container).
#   deploy/nodes/run-node.sh                         # image kvpop-serve:24.10-1, model baked in
#   IMAGE=registry.example.com/kvpop-serve:24.10-1 MODEL_REPOSITORY=/srv/kvpop/model_repository deploy/nodes/run-node.sh
# Needs the NVIDIA container toolkit (`docker run --gpus`). Two GPUs: config.pbtxt puts one engine
# instance on each; a one-GPU node picks configs/single_gpu.pbtxt by itself.
# The admin key (header kvpop-admin-key for Triton's repository/shared-memory/logging/trace/statistics
# APIs) comes from ENV_FILE, a root-only file with a line KVPOP_ADMIN_KEY=<secret>.
set -euo pipefail
IMAGE=${IMAGE:-kvpop-serve:24.10-1}
NAME=${NAME:-kvpop}
GPUS=${GPUS:-all}                       # or '"device=0,1"'
ENV_FILE=${ENV_FILE:-/etc/kvpop/env}
GRACE_SECONDS=${GRACE_SECONDS:-30}      # in-flight work gets this long to finish on `docker stop`
MODEL_REPOSITORY=${MODEL_REPOSITORY:-}  # a host folder to mount over the baked-in /models (read-only)
STATE_VOLUME=${STATE_VOLUME:-kvpop-state}  # session checkpoints (KVPOP_STATE_DIR=/var/lib/kvpop): a volume or a host folder

command -v docker >/dev/null || { echo "docker not found: install Docker and the NVIDIA container toolkit" >&2; exit 1; }
[ -r "$ENV_FILE" ] || { echo "no $ENV_FILE: create it with a line KVPOP_ADMIN_KEY=\$(openssl rand -hex 32), mode 600" >&2; exit 1; }
docker rm -f "$NAME" >/dev/null 2>&1 || true
exec docker run -d --name "$NAME" --restart unless-stopped \
  --gpus "$GPUS" --shm-size 1g --ulimit memlock=-1 \
  -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 8003:8003 -p 9000:9000 \
  --env-file "$ENV_FILE" -e KVPOP_GRACE_SECONDS="$GRACE_SECONDS" \
  --stop-timeout $((GRACE_SECONDS + 10)) \
  -v "$STATE_VOLUME:/var/lib/kvpop" \
  ${MODEL_REPOSITORY:+-v "$MODEL_REPOSITORY:/models:ro"} \
  "$IMAGE"
