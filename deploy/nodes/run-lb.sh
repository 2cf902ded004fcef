#!/usr/bin/env bash
# Start the load balancer on the main node: nginx (weighted round robin, x-session-id consistent
# hashing, passive checks) plus lb.py's active health checks, in one container built from the
# official nginx image (deploy/nodes/Dockerfile.lb, `make image-lb`).
#   sudo mkdir -p /etc/kvpop-lb && sudo cp deploy/nodes/nodes.example.txt /etc/kvpop-lb/nodes.txt  # then edit
#   deploy/nodes/run-lb.sh            # HTTP on :80, gRPC on :8001 of the main node
# Edit nodes.txt and `docker restart kvpop-lb` to add or remove a node.
set -euo pipefail
IMAGE=${IMAGE:-kvpop-lb:1.27}
NODES=${NODES:-/etc/kvpop-lb/nodes.txt}
HTTP_PORT=${HTTP_PORT:-80}
GRPC_PORT=${GRPC_PORT:-8001}   # a main node that also serves a replica: pick another port, e.g. 9001
INTERVAL=${INTERVAL:-5}        # seconds between probes of each node

command -v docker >/dev/null || { echo "docker not found" >&2; exit 1; }
[ -r "$NODES" ] || { echo "no $NODES: start from deploy/nodes/nodes.example.txt" >&2; exit 1; }
docker rm -f kvpop-lb >/dev/null 2>&1 || true
exec docker run -d --name kvpop-lb --restart unless-stopped --network host \
  -v "$NODES:/etc/kvpop-lb/nodes.txt:ro" \
  -e HTTP_LISTEN="0.0.0.0:$HTTP_PORT" -e GRPC_LISTEN="0.0.0.0:$GRPC_PORT" -e INTERVAL="$INTERVAL" \
  "$IMAGE"
