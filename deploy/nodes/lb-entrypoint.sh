#!/bin/sh
# The load balancer container: render nginx.conf from the nodes file, health-check the nodes in the
# background (re-render + reload on a change), nginx in the foreground as PID 1.
set -eu
RUN_DIR=/run/kvpop-lb
mkdir -p "$RUN_DIR"
set -- --nodes /etc/kvpop-lb/nodes.txt --out "$RUN_DIR/nginx.conf" --run-dir "$RUN_DIR" \
  --http-listen "${HTTP_LISTEN:-0.0.0.0:80}" --grpc-listen "${GRPC_LISTEN:-0.0.0.0:8001}"
python3 /opt/kvpop-lb/lb.py render "$@"
nginx -t -c "$RUN_DIR/nginx.conf"
python3 /opt/kvpop-lb/lb.py watch "$@" --interval "${INTERVAL:-5}" \
  --reload-command "nginx -c $RUN_DIR/nginx.conf -s reload" &
exec nginx -c "$RUN_DIR/nginx.conf" -g 'daemon off;'
